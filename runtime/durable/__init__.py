"""The durable checkpoint tier: a step in PyTorch Distributed Checkpoint format on storage.

Every ``checkpoint.durable_every_steps`` committed steps each rank persists the
share it just snapshotted into its node's memory (:mod:`.snapshot`) to
``checkpoint.durable_url`` — a directory (a shared path for multi-node) or any
fsspec URL (``s3://bucket/prefix``). The rank does it on a background thread
(:class:`DurableWriter`), reading its own snapshot buffer, so the training
thread pays nothing beyond handing over the buffer's path; the buffer stays
pinned (the ring does not overwrite it) until the write is over.

**Layout.** One directory a step attempt:
``<url>/<job>/step-<step>-g<generation>-w<shards>/``, holding a plain DCP
checkpoint (``.metadata`` and one ``__<shard>_0.distcp`` per shard) of the
state dict ``{"model": ..., "optimizer": ..., "extra": {name: ...},
"phalanx": {"step": ...}}``, so ``torch.distributed.checkpoint.load`` reads it
with no phalanx code. The flat state's shares cut no element
(:func:`~.snapshot_file.share`), so shard ``r`` writes the elements of its byte
range as tensor chunks (:func:`boxes`: contiguous boxes of each tensor); shard
0 also writes the non-tensor leaves (learning rates, betas, ...). A sharded
optimizer's owner also writes the entries it owns (its snapshot's second
extent), whole, under the keys a plain optimizer's would have
(``optimizer.state.<index>.<name>``): the committer lays the step out as the
consolidated state (:func:`consolidated_meta`), which loads into a plain
optimizer as well as into a sharded one at any world size.

**Commit.** Shard ``r``'s writer writes its data file, then a marker
``shard-<r>.done`` (its storage entries and the file's xxh3-64), then lists the
markers; the writer that sees all of them (the last one to finish always
does: the stores are read-after-write consistent, local file systems and S3
alike) writes ``.metadata`` and then the commit record ``.phalanx-commit``
(every file's size and checksum and the state's meta), each as one atomic
write (a rename on a file system, a single PUT on an object store). Two
writers that both see every marker write the same bytes. A step without its
commit record does not exist: a rank killed mid-write leaves an attempt that is
never loaded and that retention deletes. Retention (by every committer): the
newest ``durable_keep`` committed steps of the job stay; older steps and
abandoned attempts older than the newest committed step are deleted.

**Replica groups.** Rank ``s`` of group ``r`` (``ranks_per_replica`` S, R groups)
writes its share of column ``s``'s state, each DTensor's local elements as boxes of the
global tensor (:func:`~.layout.shard_boxes`), to data file ``s·R + r``; the directory
is ``step-<step>-g<generation>-w<R>-c<S>`` and the commit waits for all S·R markers. The
step is one DCP checkpoint of the global tensors, which a group of any size loads, each
rank its own part (:mod:`.resharding`).

**Loading** (:func:`load`, path 4 of docs/checkpoints.md): every
file's checksum is checked against the commit record before anything is
loaded; a mismatch raises :class:`DurableCorrupt` and the caller goes on to the
next older step. The state is then read with ``torch.distributed.checkpoint``
itself (``FsspecReader``), into tensors laid out as the commit record's meta
says.
"""

from phalanx.runtime.durable.layout import (
    CommitRecord,
    Committed,
    DurableCorrupt,
    boxes,
    committed_steps,
)
from phalanx.runtime.durable.resharding import DurableLayoutError
from phalanx.runtime.durable.restore import (
    DurablePolicy,
    committed_records,
    corrupt_records,
    export,
    load,
    restore,
    verify,
)
from phalanx.runtime.durable.writer import DurableWriter, Persisted, write_shard

__all__ = ["CommitRecord", "Committed", "DurableCorrupt", "DurableLayoutError", "DurablePolicy",
           "DurableWriter",
           "Persisted", "boxes", "committed_records", "committed_steps", "corrupt_records",
           "export", "load", "restore", "verify", "write_shard"]
