"""The Grafana dashboards of pdserve (serving; GPU), generated with grafana-foundation-sdk from ``panels.py``.

    .venv/bin/python -m pdserve.deploy.grafana.dashboards          # rewrite deploy/grafana/dashboards/*.json
    .venv/bin/python -m pdserve.deploy.grafana.dashboards --check  # exit 1 when the committed JSON is stale
Both have a ``datasource`` variable (any Prometheus) and a multi-select ``instance`` variable.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from grafana_foundation_sdk.builders.common import GraphThresholdsStyleConfig, VizLegendOptions
from grafana_foundation_sdk.builders.dashboard import (
    Dashboard,
    DatasourceVariable,
    QueryVariable,
    Row,
    ThresholdsConfig,
)
from grafana_foundation_sdk.builders.prometheus import Dataquery
from grafana_foundation_sdk.builders.timeseries import Panel as Timeseries
from grafana_foundation_sdk.cog.encoder import JSONEncoder
from grafana_foundation_sdk.models.common import (
    GraphThresholdsStyleMode,
    LegendDisplayMode,
    LegendPlacement,
)
from grafana_foundation_sdk.models.dashboard import (
    DataSourceRef,
    Threshold,
    ThresholdsMode,
    VariableRefresh,
    VariableSort,
)

from pdserve.deploy.grafana.panels import PanelSpec, gpu_rows, serving_rows
from pdserve.telemetry.exporter import INFO_METRIC

OUT_DIR = Path(__file__).resolve().parent / "dashboards"
DS = DataSourceRef(type_val="prometheus", uid="${datasource}")


def _panel(spec: PanelSpec, panel_id: int) -> Timeseries:
    p = (
        Timeseries()
        .id(panel_id)
        .title(spec.title)
        .description(spec.description)
        .datasource(DS)
        .unit(spec.unit)
        .min(0)
        .span(12)
        .height(8)
        .fill_opacity(10)
        .legend(
            VizLegendOptions()
            .display_mode(LegendDisplayMode.LIST)
            .placement(LegendPlacement.BOTTOM)
            .show_legend(True)
        )
    )
    if spec.max is not None:
        p = p.max(spec.max)
    if spec.slo is not None:
        p = p.thresholds(
            ThresholdsConfig()
            .mode(ThresholdsMode.ABSOLUTE)
            .steps([Threshold(value=None, color="green"), Threshold(value=spec.slo, color="red")])
        ).thresholds_style(GraphThresholdsStyleConfig().mode(GraphThresholdsStyleMode.DASHED))
    for i, q in enumerate(spec.queries):
        p = p.with_target(
            Dataquery().expr(q.expr).legend_format(q.legend).ref_id(chr(ord("A") + i)).datasource(DS)
        )
    return p


def build(uid: str, title: str, description: str, rows: Sequence[tuple[str, Sequence[PanelSpec]]]) -> dict:
    d = (
        Dashboard(title)
        .uid(uid)
        .description(description)
        .tags(["pdserve"])
        .refresh("10s")
        .time("now-30m", "now")
        .with_variable(DatasourceVariable("datasource").label("Data source").type("prometheus"))
        .with_variable(
            QueryVariable("instance")
            .label("Instance")
            .datasource(DS)
            .query(f"label_values({INFO_METRIC}, instance)")
            .multi(True)
            .include_all(True)
            .all_value(".*")
            .refresh(VariableRefresh.ON_TIME_RANGE_CHANGED)
            .sort(VariableSort.ALPHABETICAL_ASC)
        )
    )
    panel_id = 1
    for title_, specs in rows:
        d = d.with_row(Row(title_).id(panel_id))
        panel_id += 1
        for spec in specs:
            d = d.with_panel(_panel(spec, panel_id))
            panel_id += 1
    # Through json once: the SDK's objects become plain dicts, so callers compare and dump data.
    return json.loads(json.dumps(d.build(), cls=JSONEncoder))


def dashboards() -> dict[str, dict]:
    """File name -> dashboard JSON, as committed under deploy/grafana/dashboards/: ``pdserve.json``
    (serving: client-side latency with the SLO thresholds drawn, traffic, queueing, workers, the pools, the
    KV transfer, processes) and ``pdserve-gpu.json`` (what GPU hosts export: ``telemetry.gpu``)."""
    return {
        "pdserve.json": build(
            "pdserve-serving",
            "pdserve: serving",
            "TTFT and ITL at the router, traffic, queueing, workers, decode and prefill pools, KV transfer.",
            serving_rows(),
        ),
        "pdserve-gpu.json": build(
            "pdserve-gpu",
            "pdserve: GPUs",
            "GPU utilisation and memory (hosts with NVIDIA GPUs only).",
            gpu_rows(),
        ),
    }


def render(doc: dict) -> str:
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT_DIR)
    ap.add_argument("--check", action="store_true", help="compare with the files instead of writing them")
    args = ap.parse_args(argv)
    stale = []
    for name, doc in dashboards().items():
        path = args.out / name
        text = render(doc)
        if args.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(str(path))
        else:
            args.out.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(path)
    if stale:
        print(
            "stale (run `python -m pdserve.deploy.grafana.dashboards`): " + ", ".join(stale), file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
