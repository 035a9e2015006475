// Tessera console: the usage page's charts. The data comes from usage.json (the same
// SQL sums as the table and the CSV); buckets are UTC days or hours, drawn and labelled
// in UTC whatever the browser's time zone, one series per model, nothing outside the
// chosen range.
"use strict";

const COLORS = ["#2f5bd3", "#d9822b", "#17663a", "#b42318", "#7a3fd0", "#0f8a8a", "#8a6d00", "#5b6470"];

const WHOLE_STEPS = [];
for (let p = 1; p <= 1e15; p *= 10) WHOLE_STEPS.push(p, 2 * p, 5 * p);

function utcLabel(secs, by) {
  const iso = new Date(secs * 1000).toISOString();
  return by === "hour" ? iso.slice(5, 13).replace("T", " ") + ":00" : iso.slice(0, 10);
}

// Dollars from micro-dollars with as many decimals as the largest value needs (costs
// of small models are fractions of a cent), tokens as whole numbers.
function format(value, unit, largest) {
  if (value == null) return "";
  if (unit !== "usd") return Math.round(value).toLocaleString("en-US");
  const top = Math.abs(largest || value);
  const decimals = top >= 1e6 ? 2 : top >= 1e4 ? 4 : 6;
  return "$" + (value / 1e6).toFixed(decimals);
}

function draw(el, data, metric) {
  el.textContent = "";
  const unit = el.dataset.unit;
  const by = el.dataset.by;
  const series = data.series[metric] || {};
  const models = data.models;
  if (models.length === 0) {
    el.textContent = "No usage in this range.";
    return;
  }
  const first = data.buckets[0];
  const last = data.buckets[data.buckets.length - 1];
  const step = by === "hour" ? 3600 : 86400;
  const ticks = (u) => {
    const fit = Math.max(1, Math.floor(u.bbox.width / (window.devicePixelRatio || 1) / 90));
    const every = Math.ceil(data.buckets.length / fit);
    return data.buckets.filter((_, i) => i % every === 0);
  };
  const opts = {
    width: Math.max(320, el.clientWidth - 16),
    height: 280,
    // Read and label every time in UTC: the buckets are UTC days and hours.
    tzDate: (ts) => uPlot.tzDate(new Date(ts * 1000), "Etc/UTC"),
    // Half a bucket of room on each side: a one-day range still has a width.
    scales: { x: { time: true, range: [first - step / 2, last + step / 2] } },
    axes: [
      // Ticks on bucket starts only (every k-th, to fit), so no label repeats.
      { splits: (u) => ticks(u), values: (u, ts) => ts.map((t) => utcLabel(t, by)) },
      {
        values: (u, ticks) => {
          const labels = ticks.map((t) => format(t, unit, Math.max(...ticks.map(Math.abs))));
          // Kept on the element for the browser test that checks the steps.
          el.dataset.yLabels = labels.join("|");
          return labels;
        },
        size: 90,
        // Tokens come whole: steps of 1, 2 or 5 times a power of ten, never 2.5.
        ...(unit === "usd" ? {} : { incrs: WHOLE_STEPS }),
      },
    ],
    series: [
      { label: by === "hour" ? "Hour (UTC)" : "Day (UTC)", value: (u, t) => (t == null ? "" : utcLabel(t, by)) },
      ...models.map((m, i) => ({
        label: m,
        stroke: COLORS[i % COLORS.length],
        width: 2,
        points: { show: true, size: 5 },
        value: (u, v) => format(v, unit),
      })),
    ],
  };
  const rows = [data.buckets, ...models.map((m) => series[m] || [])];
  el.chart = new uPlot(opts, rows, el);
}

async function load() {
  const charts = document.querySelectorAll(".chart[data-src]");
  if (charts.length === 0 || typeof uPlot === "undefined") return;
  const response = await fetch(charts[0].dataset.src, { credentials: "same-origin" });
  if (!response.ok) return;
  const data = await response.json();
  charts.forEach((el) => draw(el, data, el.dataset.metric));
  const picker = document.getElementById("token-metric");
  const tokens = document.getElementById("token-chart");
  if (picker && tokens) {
    picker.addEventListener("change", () => {
      tokens.dataset.metric = picker.value;
      draw(tokens, data, picker.value);
    });
  }
  document.body.dataset.chartsReady = "1";
}

document.addEventListener("DOMContentLoaded", load);
