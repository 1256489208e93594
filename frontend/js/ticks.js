// Tick labels for a chart's value axis. uPlot's default rounds every label to
// three decimals, so a learning rate of 0.0005 reads "0.001" and log-prob gaps
// near 1e-7 read "0" at every tick. Here the labels keep as many digits as it
// takes to be exact to well within one tick spacing (so adjacent ticks never
// read the same): plain numbers for ordinary ranges (0..1, 0..500, 0.0001..),
// scientific notation (1e-7, 2.5e-7, 3e6) once a tick is tiny or huge.

const SMALL = 1e-4; // a tick below this (0 aside) reads better as 5e-5 than as 0.00005
const LARGE = 1e6; // and one from here on as 1e6
const MAX_DECIMALS = 20;
const MAX_DIGITS = 15; // a double's significant digits: never print float noise

// "2.50e-7" -> "2.5e-7", "1e+6" -> "1e6".
function scientific(v, digits) {
  if (v === 0) return "0";
  const [mantissa, exponent] = v.toExponential(digits - 1).split("e");
  return `${mantissa.includes(".") ? mantissa.replace(/\.?0+$/, "") : mantissa}e${Number(exponent)}`;
}

// Number() drops the zeros toFixed pads with ("0.50" -> "0.5") and turns "-0" into "0".
function plain(v, decimals) {
  return String(Number(v.toFixed(decimals)));
}

// How close a label must read back to its tick: a millionth of the smallest spacing between ticks.
function tolerance(values) {
  const sorted = [...new Set(values)].sort((a, b) => a - b);
  let gap = Infinity;
  for (let i = 1; i < sorted.length; i += 1) gap = Math.min(gap, sorted[i] - sorted[i - 1]);
  return (gap === Infinity ? Math.abs(sorted[0]) : gap) * 1e-6; // one tick: exact to a millionth of itself
}

// values: the axis' tick values (uPlot's splits); returns one label per value ("" for a non-number).
export function formatTicks(values) {
  const finite = values.filter(Number.isFinite);
  if (!finite.length) return values.map(() => "");
  const tol = tolerance(finite);
  const sizes = finite.map(Math.abs).filter((a) => a > tol); // a zero tick (or float noise) says nothing
  const sci = sizes.length > 0 && (Math.min(...sizes) < SMALL || Math.max(...sizes) >= LARGE);
  const labels = (format) => values.map((v) => (Number.isFinite(v) ? format(v) : ""));
  const exact = (format) => finite.every((v) => Math.abs(Number(format(v)) - v) <= tol);
  for (let n = sci ? 1 : 0; n <= (sci ? MAX_DIGITS : MAX_DECIMALS); n += 1) {
    const format = sci ? (v) => scientific(v, n) : (v) => plain(v, n);
    if (exact(format)) return labels(format);
  }
  return labels((v) => scientific(v, MAX_DIGITS));
}
