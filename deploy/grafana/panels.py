"""What the pdserve dashboards show: rows of panels and their PromQL, as plain typed data.

Every query filters on the dashboard's ``instance`` variable and rates over ``$__rate_interval``. Metric
names come from the modules that define the metrics, so a rename there shows up here.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.utils import floatToGoString

from pdserve.decode_pool import metrics as dm
from pdserve.prefill_pool import metrics as pm
from pdserve.router import metrics as rm
from pdserve.telemetry import gpu as gm
from pdserve.telemetry import prefix_cache as pc
from pdserve.telemetry.prefill import FAILED_STEPS
from pdserve.telemetry.slo import DEFAULT_SLO

# Made by kv_transfer on the prefill and decode workers' registries (``role`` label: which side).
KV_TRANSFER_BYTES = "pdserve_kv_transfer_bytes_total"
KV_TRANSFER_NOT_SENT = "pdserve_kv_transfer_bytes_not_sent_total"
KV_TRANSFER_SECONDS = "pdserve_kv_transfer_seconds"
KV_TRANSFER_FAILURES = "pdserve_kv_transfer_failures_total"
KV_TRANSFER_LAYER_SECONDS = "pdserve_kv_transfer_layer_seconds"
KV_TRANSFER_INFLIGHT = "pdserve_kv_transfer_inflight"
KV_TRANSFER_OPENED = "pdserve_kv_transfer_opened_total"
# Made by the router (router/moves.py): streams moved live with their KV.
LIVE_MOVES = "pdserve_router_live_moves_total"
LIVE_MOVE_PAUSE = "pdserve_router_live_move_pause_seconds"
LIVE_MOVE_BYTES = "pdserve_router_live_move_kv_bytes_total"
AUTOSCALER_DECISIONS = "pdserve_autoscaler_decisions_total"  # deploy.local.autoscaler
AUTOSCALER_TARGET = "pdserve_autoscaler_target_workers"
AUTOSCALER_CURRENT = "pdserve_autoscaler_current_workers"
AUTOSCALER_STANDBY = "pdserve_autoscaler_standby_workers"

SEL = 'instance=~"$instance"'
RATE = "$__rate_interval"
QUANTILES = (0.5, 0.9, 0.99)


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class PanelSpec:
    title: str
    description: str
    unit: str
    queries: tuple[Query, ...]
    slo: float | None = None  # drawn as a dashed threshold line
    max: float | None = None


def rate(metric: str, by: str = "") -> str:
    group = f" by ({by}) " if by else ""
    return f"sum{group}(rate({metric}{{{SEL}}}[{RATE}]))"


def quantiles(histogram: str, by: str = "", legend: str = "") -> tuple[Query, ...]:
    """p50/p90/p99 of a histogram over the selected instances (per ``by`` group when given)."""
    keep = f"le, {by}" if by else "le"
    return tuple(
        Query(
            f"histogram_quantile({q}, sum by ({keep}) (rate({histogram}_bucket{{{SEL}}}[{RATE}])))",
            f"p{round(q * 100)}{' ' + legend if legend else ''}",
        )
        for q in QUANTILES
    )


def within(histogram: str, threshold: float) -> str:
    """Fraction of observations <= threshold: exact, since the threshold is a bucket boundary."""
    le = floatToGoString(threshold)
    bucket = f'{histogram}_bucket{{{SEL}, le="{le}"}}'
    return f"sum(rate({bucket}[{RATE}])) / sum(rate({histogram}_count{{{SEL}}}[{RATE}]))"


def mean(histogram: str, by: str) -> str:
    return f"{rate(histogram + '_sum', by)} / {rate(histogram + '_count', by)}"


PER_PROCESS = "{{worker}} {{instance}}"


def serving_rows() -> list[tuple[str, list[PanelSpec]]]:
    slo = DEFAULT_SLO
    return [
        (
            "Latency at the router (the client's view)",
            [
                PanelSpec(
                    "Time to first token",
                    "From arrival at the router to the first token sent to the client.",
                    "s",
                    quantiles(rm.TTFT),
                    slo=slo.ttft_s,
                ),
                PanelSpec(
                    "Inter-token latency",
                    "Between consecutive token messages of a request.",
                    "s",
                    quantiles(rm.ITL),
                    slo=slo.itl_s,
                ),
                PanelSpec(
                    "End-to-end request latency",
                    "From arrival to the finish message.",
                    "s",
                    quantiles(rm.E2E),
                    slo=slo.e2e_s,
                ),
                PanelSpec(
                    "Requests within the SLOs",
                    "Fraction of first tokens and of token gaps within the SLO "
                    "thresholds (bucket boundaries of the histograms).",
                    "percentunit",
                    (
                        Query(within(rm.TTFT, slo.ttft_s), f"TTFT <= {slo.ttft_s:g}s"),
                        Query(within(rm.ITL, slo.itl_s), f"ITL <= {slo.itl_s:g}s"),
                    ),
                    max=1.0,
                ),
            ],
        ),
        (
            "Traffic and queueing",
            [
                PanelSpec(
                    "Requests by finish reason",
                    "Requests ended per second.",
                    "reqps",
                    (Query(rate(rm.REQUESTS, "finish_reason"), "{{finish_reason}}"),),
                ),
                PanelSpec(
                    "Tokens per second",
                    "Prompt tokens admitted and tokens streamed to clients.",
                    "short",
                    (
                        Query(rate(rm.PROMPT_TOKENS), "prompt"),
                        Query(rate(rm.GENERATION_TOKENS), "generation"),
                    ),
                ),
                PanelSpec(
                    "Queue depth",
                    "Requests running, and waiting at the router for a worker with room.",
                    "short",
                    (
                        Query(f"sum({rm.RUNNING}{{{SEL}}})", "running"),
                        Query(f"sum({rm.WAITING}{{{SEL}}})", "waiting"),
                    ),
                ),
                PanelSpec(
                    "Queue time",
                    "Time spent waiting in the router's admission queue.",
                    "s",
                    quantiles(rm.QUEUE_TIME),
                ),
                PanelSpec(
                    "Workers by role and state",
                    "As the router's registry sees them.",
                    "short",
                    (
                        Query(
                            # (each router counts every worker: the most any router sees)
                            f"max by (role, state) (sum by (role, state, instance) ({rm.WORKERS}{{{SEL}}}))",
                            "{{role}} {{state}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Autoscaler: pool sizes",
                    "Workers serving, the autoscaler's target, and warm standby workers, per pool "
                    "(`pdserve up --autoscale`).",
                    "short",
                    (
                        Query(f"max by (pool) ({AUTOSCALER_CURRENT}{{{SEL}}})", "{{pool}} serving"),
                        Query(f"max by (pool) ({AUTOSCALER_TARGET}{{{SEL}}})", "{{pool}} target"),
                        Query(f"max by (pool) ({AUTOSCALER_STANDBY}{{{SEL}}})", "{{pool}} standby"),
                    ),
                ),
                PanelSpec(
                    "Autoscaler decisions",
                    "Scale-ups and scale-downs per pool, by reason.",
                    "short",
                    (
                        Query(
                            "sum by (pool, direction, reason) "
                            f"(increase({AUTOSCALER_DECISIONS}{{{SEL}}}[{RATE}]))",
                            "{{pool}} {{direction}} ({{reason}})",
                        ),
                    ),
                ),
            ],
        ),
        (
            "Decode pool",
            [
                PanelSpec(
                    "KV cache usage per decode worker",
                    "Fraction of the worker's KV blocks in use.",
                    "percentunit",
                    (Query(f"{dm.KV_CACHE_USAGE}{{{SEL}}}", PER_PROCESS),),
                    max=1.0,
                ),
                PanelSpec(
                    "Decode batch size",
                    "Mean requests per engine step.",
                    "short",
                    (Query(mean(dm.DECODE_BATCH_SIZE, "worker, instance"), PER_PROCESS),),
                ),
                PanelSpec(
                    "Decode step time", "Wall time of one engine step.", "s", quantiles(dm.DECODE_STEP)
                ),
                PanelSpec(
                    "Failed steps",
                    "Engine steps and prefill forwards that raised, per second, by role: their requests "
                    "moved to another worker (3 in a row and the worker drains and exits).",
                    "short",
                    (Query(rate(FAILED_STEPS, "role"), "{{role}}"),),
                ),
            ],
        ),
        (
            "Prefill pool and KV transfer",
            [
                PanelSpec(
                    "Prefill time",
                    "Wall time of one batched prefill forward, by role: prefill workers, and the local "
                    "prefills of decode and colocated workers.",
                    "s",
                    quantiles(pm.PREFILL_TIME, "role", "{{role}}"),
                ),
                PanelSpec(
                    "Prefill queue",
                    "Prompt tokens queued or being prefilled, per prefill worker.",
                    "short",
                    (Query(f"{pm.PREFILL_QUEUE_TOKENS}{{{SEL}}}", PER_PROCESS),),
                ),
                PanelSpec(
                    "Prefix cache hit rate",
                    "Prompt tokens reused from a worker's prefix cache over prompt tokens looked up, by "
                    "role: prefill workers, and the local prefills of decode and colocated workers.",
                    "percentunit",
                    (
                        Query(
                            f"{rate(pc.PREFIX_HITS, 'role')} / {rate(pc.PREFIX_QUERIES, 'role')}", "{{role}}"
                        ),
                    ),
                    max=1.0,
                ),
                PanelSpec(
                    "KV bytes not sent",
                    "KV bytes of completed transfers that stayed home because the decode worker already "
                    "cached them, next to the bytes moved.",
                    "Bps",
                    (
                        Query(rate(KV_TRANSFER_NOT_SENT), "not sent"),
                        Query(rate(KV_TRANSFER_BYTES, "role"), "moved ({{role}})"),
                    ),
                ),
                PanelSpec(
                    "KV transfer throughput",
                    "KV cache bytes moved between prefill and decode workers.",
                    "Bps",
                    (Query(rate(KV_TRANSFER_BYTES, "role"), "{{role}}"),),
                ),
                PanelSpec(
                    "KV transfer latency",
                    "Duration of one request's KV transfer.",
                    "s",
                    quantiles(KV_TRANSFER_SECONDS, "role", "{{role}}"),
                ),
                PanelSpec(
                    "KV transfer failures",
                    "Failed transfers per second, by reason.",
                    "reqps",
                    (Query(rate(KV_TRANSFER_FAILURES, "role, reason"), "{{role}} {{reason}}"),),
                ),
                PanelSpec(
                    "KV transfer per-layer latency",
                    "Prefill side: from a layer's push to every message of it completed. Small against "
                    "the prefill time means the transfer hides behind the forward.",
                    "s",
                    quantiles(KV_TRANSFER_LAYER_SECONDS),
                ),
                PanelSpec(
                    "KV transfer paths",
                    "Transfers opened per second by how their KV moves: one-sided puts, cross-memory writes "
                    "or copies into a shared KV cache (--kv-shared-memory) on one host, CUDA IPC, or tagged "
                    "messages (--kv-puts, and where every UCX lane is tcp with segments under 64 KB).",
                    "reqps",
                    (Query(rate(KV_TRANSFER_OPENED, "path"), "{{path}}"),),
                ),
                PanelSpec(
                    "KV transfers in flight",
                    "Transfers open or reserved, per side.",
                    "short",
                    (Query(f"sum by (role) ({KV_TRANSFER_INFLIGHT}{{{SEL}}})", "{{role}}"),),
                ),
            ],
        ),
        (
            "Speculative decoding",
            [
                PanelSpec(
                    "Acceptance rate",
                    "Proposed tokens the target accepted over tokens proposed (--speculative), per role.",
                    "percentunit",
                    (
                        Query(
                            f"{rate(dm.SPEC_ACCEPTED_TOKENS + '_total', 'role')} / "
                            f"{rate(dm.SPEC_DRAFT_TOKENS + '_total', 'role')}",
                            "{{role}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Tokens per verify",
                    "Mean tokens a proposing stream gets from one verify forward (accepted proposals plus "
                    "the one it samples anyway); 1 is no gain.",
                    "none",
                    (
                        Query(
                            f"{rate(dm.SPEC_EMITTED_TOKENS + '_total', 'role')} / "
                            f"{rate(dm.SPEC_DRAFTS + '_total', 'role')}",
                            "{{role}}",
                        ),
                    ),
                ),
                PanelSpec(
                    "Proposed and accepted",
                    "Per second: tokens proposed, accepted, and verify forwards run.",
                    "short",
                    (
                        Query(rate(dm.SPEC_DRAFT_TOKENS + "_total", "role"), "proposed {{role}}"),
                        Query(rate(dm.SPEC_ACCEPTED_TOKENS + "_total", "role"), "accepted {{role}}"),
                        Query(rate(dm.SPEC_VERIFY_STEPS + "_total", "role"), "verify steps {{role}}"),
                    ),
                ),
            ],
        ),
        (
            "Stream moves",
            [
                PanelSpec(
                    "Streams moved",
                    "Per second: streams moved live with their KV, by cause (drain, rebalance) and outcome "
                    "(declined: not now; failed: it stayed where it was), and streams moved by re-prefill "
                    "after their worker failed, by what failed.",
                    "reqps",
                    (
                        Query(rate(LIVE_MOVES, "cause, outcome"), "live: {{cause}} {{outcome}}"),
                        Query(rate(rm.MIGRATIONS, "reason"), "re-prefill: {{reason}}"),
                    ),
                ),
                PanelSpec(
                    "Live move pause",
                    "Per moved stream: from its pause on the worker it left to its KV landing on the other.",
                    "s",
                    quantiles(LIVE_MOVE_PAUSE),
                ),
                PanelSpec(
                    "KV moved by live moves",
                    "KV bytes written moving streams live.",
                    "Bps",
                    (Query(rate(LIVE_MOVE_BYTES), "moved"),),
                ),
            ],
        ),
        (
            "Processes",
            [
                PanelSpec(
                    "CPU",
                    "CPU seconds per second of each process.",
                    "percentunit",
                    (Query(f"rate(process_cpu_seconds_total{{{SEL}}}[{RATE}])", PER_PROCESS),),
                ),
                PanelSpec(
                    "Resident memory",
                    "Resident set size of each process.",
                    "bytes",
                    (Query(f"process_resident_memory_bytes{{{SEL}}}", PER_PROCESS),),
                ),
            ],
        ),
    ]


def gpu_rows() -> list[tuple[str, list[PanelSpec]]]:
    per_gpu = "{{worker}} {{instance}} gpu {{gpu}}"
    return [
        (
            "GPUs",
            [
                PanelSpec(
                    "GPU utilisation",
                    "Busy fraction per GPU (NVML).",
                    "percentunit",
                    (Query(f"{gm.GPU_UTILIZATION}{{{SEL}}}", per_gpu),),
                    max=1.0,
                ),
                PanelSpec(
                    "GPU memory used",
                    "Memory in use per GPU, and installed.",
                    "bytes",
                    (
                        Query(f"{gm.GPU_MEMORY_USED}{{{SEL}}}", per_gpu),
                        Query(f"{gm.GPU_MEMORY_TOTAL}{{{SEL}}}", f"total {per_gpu}"),
                    ),
                ),
            ],
        ),
    ]
