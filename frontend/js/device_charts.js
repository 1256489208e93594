// Device telemetry charts (runtime/telemetry.py: device/<role>/<device>/<field>) for devices that first report
// while the page is open: a device's first point carries every field it reports, so its charts are laid out
// from that point as jobs/device_charts.py lays them out when the page is rendered.

const CHARTS = [
  ["utilisation (%)", ["util"]],
  ["memory (bytes)", ["mem_used_bytes", "mem_peak_bytes", "host_mem_used_bytes", "host_mem_total_bytes"]],
  ["power (W)", ["power_w"]],
  ["temperature (°C)", ["temp_c"]],
];
const FIELDS = new Set(CHARTS.flatMap(([, fields]) => fields));

// The charts ({title, keys}) of the devices among `keys` (one point's metric names) that `charted(key)` says
// have no chart yet.
export function newDeviceCharts(keys, charted) {
  const fieldsOf = new Map();
  for (const key of keys) {
    const parts = key.split("/");
    if (parts.length !== 4 || parts[0] !== "device" || !parts[1] || !parts[2] || !FIELDS.has(parts[3])) continue;
    if (charted(key)) continue;
    const device = `${parts[1]}/${parts[2]}`;
    if (!fieldsOf.has(device)) fieldsOf.set(device, new Set());
    fieldsOf.get(device).add(parts[3]);
  }
  const out = [];
  for (const [device, fields] of fieldsOf) {
    const [role, name] = device.split("/");
    for (const [title, names] of CHARTS) {
      const present = names.filter((f) => fields.has(f)).map((f) => `device/${role}/${name}/${f}`);
      if (present.length) out.push({ title: `${role} · ${name}: ${title}`, keys: present });
    }
  }
  return out;
}

// The Devices group's chart grid; created (open, after the other groups) when the page was rendered without it.
export function devicesGrid(doc) {
  let group = doc.getElementById("charts-devices");
  if (!group) {
    group = doc.createElement("details");
    group.className = "chart-group";
    group.id = "charts-devices";
    group.dataset.section = "charts-devices";
    group.open = true;
    const summary = doc.createElement("summary");
    const heading = doc.createElement("h3");
    heading.textContent = "Devices";
    summary.append(heading);
    const grid = doc.createElement("div");
    grid.className = "chart-grid";
    group.append(summary, grid);
    doc.getElementById("chart-groups").append(group);
  }
  return group.querySelector(".chart-grid");
}
