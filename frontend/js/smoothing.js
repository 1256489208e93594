// Exponential moving average as the chart toolbars of W&B and TensorBoard do
// it: weight w in [0, 1) (0 = off), debiased so the first points are not
// pulled towards zero. Nulls (gaps) are kept as gaps and do not reset the
// average; the x spacing is ignored (points are per step).

export function ema(values, weight) {
  if (!(weight > 0)) return values.slice();
  const out = new Array(values.length);
  let last = 0;
  let debias = 0;
  for (let i = 0; i < values.length; i += 1) {
    const v = values[i];
    if (v === null || v === undefined || !Number.isFinite(v)) {
      out[i] = null;
      continue;
    }
    last = last * weight + (1 - weight) * v;
    debias = debias * weight + (1 - weight);
    out[i] = last / debias;
  }
  return out;
}
