"""The run page's "Devices" chart group: a few charts per role and device of the run's telemetry series
(``device/<role>/<device>/<field>``, runtime/telemetry.py; names from ``runtime.contract``).

Which series a run has is read boundedly, never by scanning every point: the chart store's keys (an index
scan) and the keys of the run's first and newest few points (a role samples at once as it starts, so its
first point carries every field it reports). A device that first reports after the page was rendered gets its
charts from frontend/js/device_charts.js, laid out the same way.
"""

from __future__ import annotations

from runtime import contract as c

from .models import MetricPoint, Run, SeriesValueBlock

EDGE_POINTS = 20  # points read at each end of the run for their keys

# (chart title, fields), per device; a chart whose fields the device never reported is left out.
DEVICE_CHARTS = [
    ("utilisation (%)", [c.DEVICE_UTIL]),
    ("memory (bytes)", [c.DEVICE_MEM_USED, c.DEVICE_MEM_PEAK, c.DEVICE_HOST_MEM_USED, c.DEVICE_HOST_MEM_TOTAL]),
    ("power (W)", [c.DEVICE_POWER]),
    ("temperature (°C)", [c.DEVICE_TEMP]),
]
GROUP_TITLE = "Devices"


def device_keys(run: Run) -> list[str]:
    """The run's telemetry series names (sorted)."""
    keys = set(
        SeriesValueBlock.objects.filter(run=run, key__startswith=c.DEVICE_PREFIX)
        .values_list("key", flat=True)
        .distinct()
    )
    points = MetricPoint.objects.filter(run=run)
    for rows in (points.order_by("pk")[:EDGE_POINTS], points.order_by("-pk")[:EDGE_POINTS]):
        for metrics in rows.values_list("metrics", flat=True):
            keys.update(k for k in metrics if k.startswith(c.DEVICE_PREFIX))
    return sorted(k for k in keys if c.split_device_metric(k) is not None)


def _device_order(device: str) -> tuple[int, str, int]:
    kind = device.rstrip("0123456789")
    index = device[len(kind) :]
    return (0 if kind == "cpu" else 1, kind, int(index) if index else -1)


def device_groups(run: Run) -> list[tuple[str, list[tuple[str, list[str]]]]]:
    """``[("Devices", [(chart title, [series names])])]``, or [] when the run reported no telemetry."""
    present = set(device_keys(run))
    if not present:
        return []
    parsed = [c.split_device_metric(k) for k in present]
    devices = sorted({(p[0], p[1]) for p in parsed if p is not None}, key=lambda rd: (rd[0], _device_order(rd[1])))
    charts = []
    for role, device in devices:
        for title, fields in DEVICE_CHARTS:
            keys = [c.device_metric(role, device, f) for f in fields if c.device_metric(role, device, f) in present]
            if keys:
                charts.append((f"{role} · {device}: {title}", keys))
    return [(GROUP_TITLE, charts)]
