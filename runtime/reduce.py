"""Gradient all-reduce in buckets, started during the backward pass of a step's last micro-batch.

The parameters are cut into fixed buckets of about :data:`BUCKET_BYTES`, in
reverse registration order (roughly the order backward produces their
gradients). During the last micro-batch's backward, a post-accumulate hook
on each parameter counts it into its bucket; a full bucket is flattened and
its all-reduce started at once, so communication overlaps the rest of the
backward pass as DDP's does. Buckets are always started in bucket order, so
every rank issues the same collectives in the same order whatever order its
hooks fire in; :meth:`BucketedReduce.finish` starts what is left (a parameter
without a gradient counts as zeros) and waits for all of them.

The gradients go into the buckets by copy, so that an aborted all-reduce leaves
them whole, but come back as views: once every bucket is summed, each ``.grad``
is its slice of the bucket (DDP's ``gradient_as_bucket_view``), which spares a
copy of the whole gradient every step (4 ms of a W rank's 145 ms of CPU). The
next step reuses the buckets; where a gradient still views one then (a script
that zeroes gradients rather than setting them to None), that bucket is a new
one, as a gradient held across steps is the script's.

After the buckets, one small float64 all-reduce sums the caller's ``tail``:
the step's metrics (this rank's share of the loss, and any scalar the script
adds) and one flag (the session uses it to agree on when to switch
generations). It is started only at :meth:`BucketedReduce.finish`, when the
last micro-batch's loss is known whichever way the script reported it, and
it is waited for with the buckets, so it is abortable like them. A ``kept``
flat gradient (a repaired step's share from an aborted attempt) is added to
each bucket's slice before it is sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from phalanx.runtime.group import Group, GroupWork
from phalanx.runtime.replica_group import assign_gradient, local
from phalanx.runtime.state import Wait

#: Bucket size; DDP's default is 25 MiB.
BUCKET_BYTES = 25 * 2**20


def bucket_plan(params: Sequence[torch.nn.Parameter],
                bucket_bytes: int = BUCKET_BYTES) -> list[list[int]]:
    """Parameter indices per bucket, last parameters first."""
    buckets: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(params))):
        nbytes = local(params[i]).numel() * params[i].element_size()
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes
    return buckets


def flat_gradients(params: Sequence[torch.nn.Parameter],
                   dtype: torch.dtype | None = None) -> torch.Tensor:
    """The parameters' gradients in one flat tensor (zeros where a gradient is None)."""
    return torch.cat([(local(p.grad) if p.grad is not None else torch.zeros_like(local(p)))
                      .reshape(-1).to(dtype or p.dtype) for p in params])


def write_gradients(params: Sequence[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Copy ``flat`` (laid out as :func:`flat_gradients`) into the gradients, rounding it
    to their dtype; extra trailing elements are ignored."""
    offset = 0
    for p in params:
        shard = local(p)
        n = shard.numel()
        if p.grad is None:
            assign_gradient(p, torch.empty_like(shard))
        assert p.grad is not None
        local(p.grad).copy_(flat[offset:offset + n].view_as(shard))
        offset += n


def view_gradients(params: Sequence[torch.nn.Parameter], flat: torch.Tensor) -> None:
    """Make the gradients views of ``flat`` (laid out as :func:`flat_gradients`); a
    parameter of another dtype or device gets a copy, rounded to its dtype."""
    offset = 0
    for p in params:
        shard = local(p)
        part = flat[offset:offset + shard.numel()]
        if p.dtype == flat.dtype and p.device == flat.device:
            assign_gradient(p, part.view_as(shard))
        else:
            write_gradients([p], part)
        offset += shard.numel()


def _views(grad: torch.Tensor | None, flat: torch.Tensor) -> bool:
    """Whether ``grad`` lies in ``flat``'s memory."""
    return grad is not None and \
        local(grad).untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()


class BucketedReduce:
    """One step's gradient all-reduce, bucket by bucket.

    Args:
        pg: the generation's process group.
        params: the parameters whose gradients are summed (in a fixed order).
        plan: :func:`bucket_plan` of ``params``.
        kept: a flat float32 gradient over ``params`` to add, or None.
        tail: called once, at :meth:`finish`: a float64 vector summed over the ranks
            after the gradients (metrics and flags).
        buffers: the flat buckets of an earlier step whose all-reduce completed, to
            reuse (see :meth:`buffers_for`); None: fresh ones. Reusing them spares a
            67 MB allocation and its first writes every step on W. A bucket whose
            all-reduce was abandoned must never be reused: its gloo threads may still
            write into it.
    """

    def __init__(self, pg: Group, params: Sequence[torch.nn.Parameter],
                 plan: list[list[int]], kept: torch.Tensor | None,
                 tail: Callable[[], torch.Tensor],
                 buffers: list[torch.Tensor] | None = None) -> None:
        self.pg = pg
        self.params = params
        self.plan = plan
        self.kept = kept
        self.tail = tail
        self.offsets = [0]
        for p in params:
            self.offsets.append(self.offsets[-1] + local(p).numel())
        self.bucket_of = {i: b for b, bucket in enumerate(plan) for i in bucket}
        self.pending = [len(bucket) for bucket in plan]
        self.flats = list(buffers) if buffers is not None else self.buffers_for(params, plan)
        self.works: list[GroupWork] = []
        #: Called as the last bucket's all-reduce would be launched, before it is (fault
        #: injection: a rank dying there leaves every peer inside the step's collective).
        self.before_last_launch: Callable[[], None] | None = None

    def gradient_ready(self, index: int) -> None:
        """The hook of parameter ``index`` fired: its gradient is final for this step."""
        self.pending[self.bucket_of[index]] -= 1
        while len(self.works) < len(self.plan) and self.pending[len(self.works)] == 0:
            self._launch(len(self.works))

    @staticmethod
    def buffers_for(params: Sequence[torch.nn.Parameter],
                    plan: list[list[int]]) -> list[torch.Tensor]:
        """One flat buffer per bucket, where the parameters are."""
        sizes = [sum(local(params[i]).numel() for i in bucket) for bucket in plan]
        first = local(params[plan[0][0]])
        return [torch.empty(n, dtype=first.dtype, device=first.device) for n in sizes]

    def _launch(self, b: int) -> None:
        # A copy: the gradients stay as they are until every bucket is done, so an aborted
        # all-reduce leaves them whole (the step keeps them). Gradients still viewing this
        # bucket from the step before (kept, not set to None) are this step's own: the
        # bucket is then a new one.
        flat = self.flats[b]
        if any(_views(self.params[i].grad, flat) for i in self.plan[b]):
            flat = self.flats[b] = torch.empty_like(flat)
        offset = 0
        for i in self.plan[b]:
            p = self.params[i]
            n = self.offsets[i + 1] - self.offsets[i]
            part = flat[offset:offset + n]
            if p.grad is None:
                part.zero_()
            else:
                part.copy_(local(p.grad).reshape(-1))
            if self.kept is not None:
                part.add_(self.kept[self.offsets[i]:self.offsets[i + 1]])
            offset += n
        if b == len(self.plan) - 1 and self.before_last_launch is not None:
            self.before_last_launch()
        self.works.append(self.pg.allreduce([flat]))

    def finish(self, wait: Wait) -> torch.Tensor:
        """Start the remaining buckets and the tail, wait for all, make the gradients the
        sums: views of the buckets (as DDP's ``gradient_as_bucket_view``), no copy back.

        Returns the tail summed over the ranks. Whatever ``wait`` raises (an abort)
        propagates, with the gradients untouched.
        """
        while len(self.works) < len(self.plan):
            self._launch(len(self.works))
        tail = self.tail().to(torch.float64)
        works = [*self.works, self.pg.allreduce([tail])]
        for work in works:
            wait(work)
        for bucket, flat in zip(self.plan, self.flats, strict=True):
            view_gradients([self.params[i] for i in bucket], flat)
        return tail

    def local_gradient(self) -> torch.Tensor:
        """This rank's own flat gradient (with ``kept``), e.g. to keep after an abort."""
        flat = flat_gradients(self.params)
        return flat if self.kept is None else flat + self.kept
