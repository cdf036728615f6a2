"""The workload of test_sync_batchnorm_job.py: examples/cnn_model.py's CNN with SyncBatchNorm.

The DDP-shaped loop of the port (``session.epochs``, ``session.loader``,
``session.backward`` so that the record holds every step's loss, or the plain
``loss.backward()`` with ``--plain-backward``; clipping,
``session.commit()``), with ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` as
a DDP script converts its model. With ``--micro-batch`` the global batch, every
member runs one micro-batch a step at any membership, and its statistics are
over the whole global batch: what the script alone computes with plain
BatchNorm (it is BatchNorm alone), and what DDP with SyncBatchNorm computes
when each rank runs one batch. Plain SGD with momentum (the example's AdamW and
schedule are the port's concern, not this one's). ``--save`` writes the model's
``state_dict``.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from phalanx.examples.cnn_model import CNN, arguments, dataset
from phalanx.runtime import ElasticSession


def main() -> None:
    parser = arguments(__doc__)
    parser.add_argument("--plain-backward", action="store_true",
                        help="loss.backward(): the session's hooks weight the gradients")
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(CNN())
    optimizer = torch.optim.SGD(model.parameters(), lr=10 * args.lr, momentum=0.9)
    session = ElasticSession.from_env(model, optimizer, dataset(args), args.global_batch,
                                      seed=args.seed, micro_batch_size=args.micro_batch,
                                      drop_last=True)
    for _ in session.epochs(args.epochs):
        for x, y in session.loader:
            loss = F.cross_entropy(model(x), y)
            if args.plain_backward:
                loss.backward()
            else:
                session.backward(loss)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            session.commit()
    if session.is_primary and args.save:
        torch.save(model.state_dict(), args.save)
    session.close()


if __name__ == "__main__":
    main()
