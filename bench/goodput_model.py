"""Goodput projected to 1k-100k GPUs: one model of ETTR for phalanx, torchft and torchrun + DCP.

ETTR (effective training time ratio) is the share of wall time that ends as kept
training. Failures arrive at a fixed rate per GPU-hour, so a job of N GPUs fails every
``MTTF(N) = 1 / (rate x N)`` (Kokolis et al.'s model); each failure is of one kind
(a rank's process, a hang, a node lost), drawn by Llama 3's mix; each system loses, per
failure of each kind, a number of seconds of the whole job's training, by cause, each
cause a function of N. Besides failures a system may pay a share of every step
(checkpoints, snapshots, a quorum per step). Then

    ETTR = (1 - lost per failure / MTTF) x (1 - steady overhead)

to first order: a failure during a recovery is counted as if it fell in training, which
holds while the time lost per failure is small against the MTTF (the JSON gives that
ratio per row, ``lost_over_mttf``: 4 % or less up to 16,384 GPUs, about 20 % at 100,000
for phalanx and torchrun, where the figure is rougher).

Lost seconds are whole-job seconds: a stall of the whole job counts fully; a replica
group of S GPUs out of N while the others train counts S / N of its duration.

Every input is an :class:`Input`: a value with its unit, what kind it is (measured here,
fitted from measurements here, published, or an assumption) and its source: for a
measurement, the bench, the command and the date bench/RESULTS.md records; for an
assumption, why. Where a measured cost grows with N and bench/RESULTS.md has it at
several sizes, :func:`fit_linear` fits the growth and the fit is the input (the points
are listed with it). Nothing here runs a process: the model is arithmetic, and
``bench/goodput.py --project`` prints it.

Limits, plainly: the measured costs come from a 2-core CPU VM (and, where named, one
H200); the sizes beyond them are extrapolated from at most four sizes; the workload
(a Llama-3-405B-like job, weak-scaled) and the hardware rates are assumptions; the
model ignores failures during recovery, correlated failures and planned maintenance.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

SYSTEMS = ("phalanx", "torchft", "torchrun")
KINDS = ("rank", "hang", "node")
#: The sizes the issue asks for (GPUs).
SIZES = (1024, 4096, 16384, 100_000)


@dataclasses.dataclass(frozen=True)
class Input:
    """One number the model uses, with where it comes from.

    ``kind`` is ``measured`` (a figure in bench/RESULTS.md or taken here by a command
    named in ``source``), ``fit`` (a growth fitted to measured points), ``published`` (a
    paper's figure) or ``assumption`` (not measurable here: ``source`` says why this value).
    """

    value: float
    unit: str
    kind: str
    source: str

    def __post_init__(self) -> None:
        if self.kind not in ("measured", "fit", "published", "assumption"):
            raise ValueError(f"kind {self.kind!r}: measured, fit, published or assumption")
        if not self.source:
            raise ValueError("every input names its source")


@dataclasses.dataclass(frozen=True)
class Line:
    """``intercept + slope x size``, fitted by least squares to measured ``points``."""

    intercept: float
    slope: float
    points: tuple[tuple[float, float], ...]

    def at(self, size: float) -> float:
        return max(0.0, self.intercept + self.slope * size)


def fit_linear(points: Sequence[tuple[float, float]]) -> Line:
    """The least-squares line through ``(size, value)`` points (two or more sizes)."""
    xs = [x for x, _ in points]
    if len(set(xs)) < 2:
        raise ValueError(f"a line needs two sizes or more, got {sorted(set(xs))}")
    mx = sum(xs) / len(xs)
    my = sum(y for _, y in points) / len(points)
    slope = (sum((x - mx) * (y - my) for x, y in points)
             / sum((x - mx) ** 2 for x in xs))
    return Line(my - slope * mx, slope, tuple(points))


# --- the rules ----------------------------------------------------------------------


def mttf_s(gpus: float, failures_per_gpu_hour: float) -> float:
    """A job's mean time to failure: the rate per GPU-hour times its GPUs, inverted."""
    return 3600.0 / (failures_per_gpu_hour * gpus)


def rate_from_mttf(mttf_h: float, gpus: float) -> float:
    """Failures per GPU-hour from a published MTTF at a size (MTTF scales as 1/N)."""
    return 1.0 / (mttf_h * gpus)


def young_daly_s(checkpoint_s: float, mtbf_s: float) -> float:
    """The checkpoint interval that minimises expected lost time: sqrt(2 C MTBF)."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def ettr(lost_per_failure_s: float, mttf: float, overhead: float) -> float:
    """``(1 - lost / MTTF) x (1 - overhead)``, never below 0."""
    return max(0.0, 1.0 - lost_per_failure_s / mttf) * (1.0 - overhead)


# --- the inputs ---------------------------------------------------------------------

SCALE_RUN = ("bench/scale.py, `python bench/scale.py --nodes 100 200 400 800 2000 "
             "--start-timeout-s 120` (Wed Nov 25 23:35:19 UTC 2026) and `... 180` (Thu Nov "
             "26 02:12:02 and 02:51:58), `python bench/scale.py --nodes 100 200 400 "
             "--start-timeout-s 120` (Thu Nov 26 02:58:51), p99 of each run at 100 and 200 "
             "simulated nodes of 8 ranks; from 400 nodes the load generator saturated the "
             "2-core machine, so larger sizes are left out")

INPUTS: dict[str, Input] = {
    # Failures.
    "mttf_16k_h": Input(1.8, "h", "published",
                        "Kokolis et al., 'Revisiting Reliability in Large-Scale Machine "
                        "Learning Research Clusters', HPCA 2025 (arXiv 2410.21680): "
                        "projected MTTF at 16,384 GPUs; ~14 min at 131,072 follows from "
                        "the same 1/N rate"),
    "mix_node": Input(0.714, "share", "published",
                      "Llama 3 (arXiv 2407.21783, table 5), 419 unexpected interruptions "
                      "in 54 days on 16,384 H100s: hardware that takes a node out of "
                      "service (faulty GPU 30.1 %, HBM3 17.2 %, host maintenance 7.6 %, "
                      "GPU SRAM 4.5 %, GPU system processor 4.1 %, NIC 1.7 %, SDC 1.4 %, "
                      "thermal 1.4 %, SSD, PSU, chassis, IO board, CPU, DRAM 3.4 %); "
                      "normalised with the two below"),
    "mix_hang": Input(0.101, "share", "published",
                      "Llama 3 table 5: network switch/cable 8.4 %, NCCL watchdog "
                      "timeouts 1.7 %: the job stops making progress, nothing exits"),
    "mix_rank": Input(0.134, "share", "published",
                      "Llama 3 table 5: software bug 12.9 %, dependency 0.5 %: a process "
                      "exits, its GPU and node stay usable"),
    # The workload: a Llama-3-405B-like job, weak-scaled with N.
    "step_s": Input(6.0, "s", "assumption",
                    "Llama 3 405B on 16,384 H100s: 6 x 405e9 params x 16M tokens a step "
                    "/ (16,384 GPUs x ~400 TFLOP/s) = 5.9 s; weak scaling keeps it at "
                    "every N"),
    "group_gpus": Input(128.0, "GPUs", "assumption",
                        "the model-parallel group one failure takes out (TP 8 x PP 16, "
                        "Llama 3 405B's layout): the replica group that phalanx and "
                        "torchft drop and replace while the other groups train. phalanx's "
                        "replica groups live on one node today (docs/hsdp.md): a "
                        "128-GPU group is a premise, and VARIANTS projects 8-GPU ones"),
    "state_per_gpu_gb": Input(8.0, "GB", "assumption",
                              "what a replacement GPU must receive: its bf16 weight shard "
                              "(405e9 x 2 B / 128 = 6.3 GB) and its optimizer shard, "
                              "rounded up"),
    "ckpt_per_gpu_gb": Input(0.4, "GB", "assumption",
                             "what each GPU writes to a DCP checkpoint: the unique state, "
                             "16 B a parameter (bf16 weights, fp32 master and two Adam "
                             "moments) x 405e9 / 16,384"),
    "gpus_per_node": Input(8.0, "GPUs", "assumption", "an H100/H200 HGX node"),
    # Spares.
    "spare_start_s": Input(0.666, "s", "measured",
                           "bench/RESULTS.md 'Warm spares on a GPU — 2026-11-27 13:10, "
                           "NVIDIA H200': `bench/gpu.py --phases a --spares 1`, kill to the "
                           "first step at full strength with a warm spare. Every system is "
                           "given a free spare at every failure (spare capacity kept, as "
                           "large clusters keep it); without one a group stays out until "
                           "its node is repaired, which the model does not cover"),
    # Detection.
    "hang_timeout_s": Input(2.0, "s", "measured",
                            "phalanx's default hang_timeout_s (DESIGN.md targets); "
                            "bench/detect.py `.venv/bin/python bench/detect.py`, Sun Nov 22 "
                            "02:22:37 UTC 2026: hang -> fault 3.6 ms p99 beyond the timeout"),
    "node_timeout_s": Input(3.252, "s", "measured",
                            f"health's node timeout lost_after_s 3 s (its default) + 252 ms, "
                            f"the worst of the runs' p99 beyond it (35 to 252 ms) when a "
                            f"rack of 50 nodes froze at 200 nodes: {SCALE_RUN}"),
    "torch_timeout_s": Input(5.0, "s", "measured",
                             "the collective timeout torchft and torchrun ran with in "
                             "bench/goodput.py (`--torch-timeout`, default 5 s), Mon Dec 7 "
                             "01:10:25 UTC 2026; torch's own default is 10 min (NCCL): this "
                             "assumes them tuned as the bench tuned them"),
    "torchrun_hang_extra_s": Input(30.0, "s", "measured",
                                   "bench/goodput.py `--mtbf 60 15 --duration 120`, Mon Dec 7 "
                                   "01:10:25 UTC 2026 (notes): torch 2.13's agent waits 30 s "
                                   "for a SIGTERMed worker before SIGKILL "
                                   "(LocalElasticAgent._stop_workers), and a hung one never "
                                   "exits"),
    "torchrun_node_timeout_s": Input(15.0, "s", "assumption",
                                     "torch elastic's c10d rendezvous keep-alive (5 s "
                                     "interval x 3 attempts) before a lost agent's node is "
                                     "dropped; measured 4 to 29 s on the loaded 2-core VM "
                                     "(bench/goodput.py, Mon Dec 7 01:10:25 UTC 2026)"),
    # Decision and fan-out.
    "generation_bytes_per_member": Input(71.2, "B", "measured",
                                         "phalanx.schemas.codec.encode of a Generation of "
                                         "1,024 members (ids 'r<i>-0', nodes 'node-<5 "
                                         "digits>', endpoints ip:port): 72,955 B, taken "
                                         "here 2026-12-07 and held to it by "
                                         "tests/unit/test_bench_goodput_model.py; the "
                                         "codec refuses more than 1 MiB, about 14,700 "
                                         "members"),
    "bus_egress_gbps": Input(10.0, "GB/s", "assumption",
                             "what the NATS servers together deliver to subscribers "
                             "(a few servers on 100 Gb/s NICs); not measured here "
                             "(bench/bus.py measures round trips, one in flight)"),
    # Rendezvous and communicators.
    "nccl_init_base_s": Input(0.023, "s", "measured",
                              "bench/gpu.py `--phases b,c`, Fri Nov 27 10:04:30 UTC 2026, "
                              "H200: full NCCL initialisation, median, one rank"),
    "nccl_init_per_rank_ms": Input(0.2, "ms", "assumption",
                                   "NCCL's bootstrap exchanges every rank's address "
                                   "(linear in ranks); 0.2 ms a rank is not measured here "
                                   "(one GPU): 3.3 s at 16,384 ranks"),
    # State.
    "copy_gbps": Input(0.982, "GB/s", "measured",
                       "bench/replication.py `bench/replication.py --repeat 7`, Sat Nov 28 "
                       "10:13:49 UTC 2026: a snapshot buffer to a buddy, 982 MB/s (one "
                       "stream, loopback, 2 cores); used for every system's state copy, "
                       "one stream per GPU in parallel; NCCL over InfiniBand would be "
                       "tens of GB/s"),
    "snapshot_overhead": Input(0.002, "share", "measured",
                               "bench/gpu.py `--phases b,c`, Fri Nov 27 10:04:30 UTC 2026, "
                               "H200: compute slowed 0.2 % by the snapshot copy beside it "
                               "(phalanx's per-step snapshot on a GPU)"),
    "dcp_write_gbps": Input(0.0757, "GB/s", "measured",
                            "bench/goodput.py `--mtbf 60 --duration 120`, Mon Dec 7 "
                            "01:01:24 UTC 2026: a DCP checkpoint 665 ms for 201,437,344 B "
                            "over 4 ranks, 75.7 MB/s a rank; reads taken as fast"),
    "storage_gbps_per_gpu": Input(0.122, "GB/s", "assumption",
                                  "Llama 3's storage sustained 2 TB/s for 16,384 GPUs "
                                  "(peak 7 TB/s): 122 MB/s a GPU, provisioned in "
                                  "proportion at every N"),
    "restart_s": Input(5.41, "s", "measured",
                       "bench/recovery.py `bench/recovery.py --repeat 3`, Sat Nov 28 "
                       "06:29:22 UTC 2026: torchrun + DCP's downtime after a SIGKILL, 4 "
                       "ranks (agent restart, imports, rendezvous, DDP, dcp.load); a "
                       "restarted torchft group pays the same"),
    "torchft_quorum_s": Input(2.0, "s", "measured",
                              "bench/goodput.py `--mtbf 60 15 --duration 120`, Mon Dec 7 "
                              "01:10:25 UTC 2026: ~7 s stalled per failure with 5 s "
                              "timeouts, the rest the new quorum (notes)"),
    "loader_save_s": Input(1800.0, "s", "assumption",
                           "how often a torchft job saves its loaders' positions durably "
                           "(torchft's recovery needs no checkpoint; its train_ddp.py saves "
                           "none, and bench/goodput.py saw a restarted group read its shard "
                           "from the start again, 736 and 1,344 samples repeated): every "
                           "30 min, so a restarted group trains 15 min of its batches again "
                           "on average"),
    "lighthouse_per_group_ms": Input(0.05, "ms", "assumption",
                                     "torchft's one lighthouse computes a quorum every step "
                                     "from every replica group's request; 50 us a group "
                                     "serial in it, not measured here"),
    "quorum_hidden_share": Input(0.33, "share of a step", "assumption",
                                 "torchft starts each step's quorum beside the forward "
                                 "pass and waits for it before the gradients' all-reduce: "
                                 "hidden up to the forward pass, a third of a step"),
}

@dataclasses.dataclass(frozen=True)
class Growth:
    """A cost measured at several sizes, fitted as a line in ``per`` (its size unit)."""

    points: tuple[tuple[float, float], ...]
    unit: str
    per: str
    source: str

    def line(self) -> Line:
        return fit_linear(self.points)


RENDEZVOUS_RUN = ("bench/rendezvous.py `.venv/bin/python bench/rendezvous.py --members 128 "
                  "256 512 1024 --repeat 1 --no-record` (Mon Dec 7 05:12 UTC 2026: 128 to "
                  "512; its 1,024 hung making connections, as RESULTS.md's run of Dec 6 "
                  "23:38 did) and `... --members 1024 --processes 8 --repeat 1 --no-record` "
                  "(Mon Dec 7 05:17:38 UTC 2026); members are threads of 4 or 8 processes "
                  "on the 2-core VM, so the round's time is mostly the simulation's (the "
                  "store's CPU: 0.03 s of 0.174 s at 1,024): a conservative line")

GROWTHS: dict[str, Growth] = {
    "crash_to_fault_ms": Growth(((100.0, 4.4), (200.0, 8.8), (100.0, 2.9), (200.0, 5.7),
                                 (100.0, 2.5), (200.0, 5.0), (100.0, 2.2), (200.0, 6.1)),
                                "ms", "node", f"crash -> fault p99: {SCALE_RUN}"),
    "decide_ms": Growth(((100.0, 5.1), (200.0, 9.0), (100.0, 5.3), (200.0, 16.3),
                         (100.0, 5.2), (200.0, 10.6), (100.0, 3.7), (200.0, 7.7)),
                        "ms", "node",
                        f"fault -> the new generation at every member, p99 (health, "
                        f"elasticity and the bus; 8-rank jobs): {SCALE_RUN}"),
    "rendezvous_s": Growth(((128.0, 0.010), (256.0, 0.021), (512.0, 0.058),
                            (1024.0, 0.174)), "s", "member",
                           "the runtime's count-in on rank 0's store (an add and a wait a "
                           "member), warm: " + RENDEZVOUS_RUN),
    "torch_barrier_s": Growth(((128.0, 0.012), (256.0, 0.022), (512.0, 0.051),
                               (1024.0, 0.525), (1024.0, 0.118), (1024.0, 0.147)),
                              "s", "member",
                              "torch's store barrier (as torchrun's c10d rendezvous and "
                              "process-group start use it), warm, the same runs, and the "
                              "two 1,024-member rounds of bench/rendezvous.py `--members "
                              "1024 4096 16384 --repeat 1 --no-record` in RESULTS.md (Sun "
                              "Dec 6 23:38 and 23:45 UTC 2026): " + RENDEZVOUS_RUN),
}


# --- per system: seconds of the whole job lost per failure, by cause ----------------

Values = dict[str, float]
Lines = dict[str, Line]


def values(inputs: dict[str, Input] = INPUTS) -> Values:
    """The inputs' values by name, with the failure rate per GPU-hour derived."""
    v = {name: i.value for name, i in inputs.items()}
    v["rate"] = rate_from_mttf(v["mttf_16k_h"], 16384)
    return v


def mix(v: Values) -> dict[str, float]:
    """The failure kinds' shares, normalised to 1."""
    total = sum(v[f"mix_{k}"] for k in KINDS)
    return {k: v[f"mix_{k}"] / total for k in KINDS}


def nccl_init_s(ranks: float, v: Values) -> float:
    """A communicator of ``ranks`` from nothing."""
    return v["nccl_init_base_s"] + v["nccl_init_per_rank_ms"] / 1000 * ranks


def copy_s(v: Values) -> float:
    """One GPU's state to its replacement (a group's GPUs copy in parallel)."""
    return v["state_per_gpu_gb"] / v["copy_gbps"]


def checkpoint_s(v: Values) -> float:
    """A DCP checkpoint: each GPU's share at the slower of DCP's rate and storage's."""
    return v["ckpt_per_gpu_gb"] / min(v["dcp_write_gbps"], v["storage_gbps_per_gpu"])


def generation_fanout_s(n: float, v: Values) -> float:
    """A generation lists every member and every member receives it: n^2 bytes."""
    return n * n * v["generation_bytes_per_member"] / (v["bus_egress_gbps"] * 1e9)


def phalanx(kind: str, n: float, v: Values, f: Lines) -> dict[str, float]:
    """Live recovery: the survivors abort the step in flight, rendezvous without the
    lost group and train on at the same step; a warm spare joins at a step boundary,
    after a second generation, rendezvous and rebuild, and everyone pauses while it
    receives its state. Its group is out meanwhile."""
    nodes = n / v["gpus_per_node"]
    detect = {"rank": f["crash_to_fault_ms"].at(nodes) / 1000,
              "hang": v["hang_timeout_s"], "node": v["node_timeout_s"]}[kind]
    decide = f["decide_ms"].at(nodes) / 1000
    # The replicate dimension's groups (n / S ranks each) are built in parallel.
    rebuild = nccl_init_s(n / v["group_gpus"], v)
    return {"detect": detect, "decide": 2 * decide,
            "generation_fanout": 2 * generation_fanout_s(n, v),
            "rendezvous": 2 * f["rendezvous_s"].at(n), "rebuild": 2 * rebuild,
            "redo": v["step_s"] / 2, "state_copy": copy_s(v),
            "degraded": v["group_gpus"] / n * v["spare_start_s"]}


def torchft(kind: str, n: float, v: Values, f: Lines) -> dict[str, float]:
    """Live recovery per replica group: the others stall until their collective times
    out and a quorum forms without the lost group, then train on. The lost group (a
    hung one once its own watchdog kills it) restarts, receives its state from a peer
    and rejoins at a quorum, which reconfigures the others' groups again. Its loader
    starts over from the last saved position: half of ``loader_save_s`` of its own
    batches is trained again."""
    replicas = n / v["group_gpus"]
    reconfigure = v["torchft_quorum_s"] + nccl_init_s(replicas, v)
    stall = v["torch_timeout_s"] + reconfigure
    out_s = (stall + v["torch_timeout_s"] * (kind == "hang") + v["restart_s"]
             + v["spare_start_s"] * (kind == "node") + nccl_init_s(v["group_gpus"], v)
             + copy_s(v))
    share = v["group_gpus"] / n
    return {"detect": v["torch_timeout_s"], "rebuild": 2 * reconfigure,
            "redo": v["step_s"] / 2, "degraded": share * out_s,
            "data_reread": share * v["loader_save_s"] / 2}


def torchrun(kind: str, n: float, v: Values, f: Lines) -> dict[str, float]:
    """Stop everything, restart every worker, rendezvous, load the last checkpoint and
    train again what came after it (half a Young/Daly interval on average)."""
    detect = {"rank": 0.0,  # the agent sees its worker exit: inside restart_s
              "hang": v["torch_timeout_s"] + v["torchrun_hang_extra_s"],
              "node": v["torchrun_node_timeout_s"]}[kind]
    load = v["state_per_gpu_gb"] / min(v["dcp_write_gbps"], v["storage_gbps_per_gpu"])
    return {"detect": detect,
            "restart": v["restart_s"] + v["spare_start_s"] * (kind == "node"),
            "rendezvous": f["torch_barrier_s"].at(n), "rebuild": nccl_init_s(n, v),
            "state_load": load,
            "redo": young_daly_s(checkpoint_s(v), mttf_s(n, v["rate"])) / 2}


def phalanx_overhead(n: float, v: Values) -> float:
    """The per-step snapshot, copied beside compute."""
    return v["snapshot_overhead"]


def torchft_overhead(n: float, v: Values) -> float:
    """The lighthouse's quorum every step, serial in the number of replica groups,
    beyond what the forward pass hides."""
    quorum_s = v["lighthouse_per_group_ms"] / 1000 * n / v["group_gpus"]
    return max(0.0, quorum_s - v["quorum_hidden_share"] * v["step_s"]) / v["step_s"]


def torchrun_overhead(n: float, v: Values) -> float:
    """A checkpoint every Young/Daly interval."""
    return checkpoint_s(v) / young_daly_s(checkpoint_s(v), mttf_s(n, v["rate"]))


@dataclasses.dataclass(frozen=True)
class SystemModel:
    """A system: seconds of the whole job lost per failure by cause (given the kind,
    N, the input values and the fitted growths), and the share of every step it pays."""

    lost: Callable[[str, float, Values, Lines], dict[str, float]]
    overhead: Callable[[float, Values], float]


MODELS: dict[str, SystemModel] = {
    "phalanx": SystemModel(phalanx, phalanx_overhead),
    "torchft": SystemModel(torchft, torchft_overhead),
    "torchrun": SystemModel(torchrun, torchrun_overhead),
}


@dataclasses.dataclass(frozen=True)
class Projection:
    """One system at one size: its ETTR and what it is made of."""

    system: str
    gpus: int
    mttf_s: float
    ettr: float
    overhead: float
    lost_per_failure_s: float
    by_cause_s: dict[str, float]  # per failure, weighted by the mix


def project(system: str, n: int, v: Values | None = None,
            lines: Lines | None = None) -> Projection:
    """``system``'s ETTR at ``n`` GPUs."""
    v = values() if v is None else v
    lines = {k: g.line() for k, g in GROWTHS.items()} if lines is None else lines
    shares = mix(v)
    by_cause: dict[str, float] = {}
    for kind, share in shares.items():
        for cause, s in MODELS[system].lost(kind, n, v, lines).items():
            by_cause[cause] = by_cause.get(cause, 0.0) + share * s
    lost = sum(by_cause.values())
    mttf = mttf_s(n, v["rate"])
    extra = MODELS[system].overhead(n, v)
    return Projection(system, n, mttf, ettr(lost, mttf, extra), extra, lost, by_cause)


#: What-ifs: the projection again with some inputs changed, each named for what it tries.
VARIANTS: dict[str, dict[str, float]] = {
    "replica groups of one node (8 GPUs), phalanx's HSDP as built": {"group_gpus": 8.0},
    "state copied at 25 GB/s (NCCL over 200 Gb/s a GPU), not the measured 0.98":
        {"copy_gbps": 25.0},
    "torch's default collective timeout (10 min) for torchft and torchrun":
        {"torch_timeout_s": 600.0},
    "NCCL initialisation twice as slow a rank (0.4 ms)": {"nccl_init_per_rank_ms": 0.4},
    "a replacement receives 4x the state (32 GB a GPU)": {"state_per_gpu_gb": 32.0},
}


def sensitivity(n: int) -> dict[str, dict[str, float]]:
    """Each variant's ETTR at ``n`` GPUs, by system."""
    lines = {k: g.line() for k, g in GROWTHS.items()}
    out = {}
    for name, changes in VARIANTS.items():
        v = values() | changes
        out[name] = {s: round(project(s, n, v, lines).ettr, 5) for s in SYSTEMS}
    return out


# --- the report ---------------------------------------------------------------------


def max_generation_members(v: Values, max_payload_bytes: int) -> int:
    """The most members a generation can list within the bus's payload limit."""
    return int(max_payload_bytes // v["generation_bytes_per_member"])


def projections(sizes: Sequence[int] = SIZES) -> list[Projection]:
    """Every system at every size, in that order."""
    v = values()
    lines = {k: g.line() for k, g in GROWTHS.items()}
    return [project(s, n, v, lines) for n in sizes for s in SYSTEMS]


def report(rows: Sequence[Projection], max_payload_bytes: int) -> dict[str, object]:
    """Every projection, every input with its source, and what blocks a size: the JSON
    ``bench/goodput.py --project`` prints."""
    v = values()
    lines = {k: g.line() for k, g in GROWTHS.items()}
    sizes = sorted({p.gpus for p in rows})
    limit = max_generation_members(v, max_payload_bytes)
    inputs: dict[str, object] = {name: dataclasses.asdict(i) for name, i in INPUTS.items()}
    for name, g in GROWTHS.items():
        line = lines[name]
        inputs[name] = {"kind": "fit", "unit": g.unit, "per": g.per, "source": g.source,
                        "points": [list(p) for p in g.points], "form": "linear",
                        "intercept": line.intercept, "slope": line.slope}
    return {
        "sizes": list(sizes), "systems": list(SYSTEMS),
        "failures_per_gpu_hour": v["rate"], "mix": mix(v),
        "projections": [
            {"system": p.system, "gpus": p.gpus, "ettr": round(p.ettr, 5),
             "mttf_s": round(p.mttf_s, 1), "overhead": round(p.overhead, 5),
             "lost_per_failure_s": round(p.lost_per_failure_s, 3),
             "lost_over_mttf": round(p.lost_per_failure_s / p.mttf_s, 5),
             "dominant_cause": dominant(p),
             "lost_per_failure_by_cause_s": {k: round(x, 3)
                                             for k, x in p.by_cause_s.items()}}
            for p in rows],
        "phalanx_max_generation_members": limit,
        "blocked": [{"system": "phalanx", "gpus": n,
                     "why": f"a generation of {n:,} members encodes to "
                            f"{n * v['generation_bytes_per_member'] / 2**20:.2f} MiB, over "
                            f"the codec's {max_payload_bytes / 2**20:g} MiB limit "
                            f"({limit:,} members): the projection assumes it lifted"}
                    for n in sizes if n > limit],
        "sensitivity_16384": sensitivity(16384),
        "inputs": inputs,
    }


def dominant(p: Projection) -> str:
    """The cause of most of a failure's lost time."""
    return max(p.by_cause_s, key=lambda c: p.by_cause_s[c])


def table(rows: Sequence[Projection]) -> str:
    """ETTR per size (rows) and system (columns), then each one's loss per failure and
    its largest cause, as Markdown."""
    by = {(p.gpus, p.system): p for p in rows}
    sizes = sorted({p.gpus for p in rows})
    out = ["| GPUs | MTTF | " + " | ".join(f"{s} ETTR" for s in SYSTEMS) + " | "
           + " | ".join(f"{s}: lost per failure (s), largest cause" for s in SYSTEMS)
           + " |",
           "|---:|---:|" + "---:|" * len(SYSTEMS) + "---|" * len(SYSTEMS)]
    for n in sizes:
        cells = [by[(n, s)] for s in SYSTEMS]
        out.append(f"| {n:,} | {cells[0].mttf_s / 3600:.2f} h | "
                   + " | ".join(f"{p.ettr * 100:.2f} %" for p in cells) + " | "
                   + " | ".join(f"{p.lost_per_failure_s:.1f} ({dominant(p)} "
                                f"{p.by_cause_s[dominant(p)]:.1f})" for p in cells) + " |")
    return "\n".join(out) + "\n"
