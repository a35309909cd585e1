/*
 * The Training view: one chart per report() metric against the step, the run's progress, ETA and
 * world size, from GET <root>/api/runs/<dag>/<run>/<task>?map_index=N, every 2 s until the task
 * ends. Plain JavaScript that draws SVG: no build step, nothing loaded from elsewhere.
 *
 * Theme, first that applies: ?theme=dark|light; the Airflow UI around this iframe (the class
 * "dark" or "light" that it puts on its <html>); the UI's choice in localStorage "theme" (shared on
 * the same origin; "system" follows the OS); the OS's prefers-color-scheme. It follows changes of
 * each as they happen.
 */
"use strict";

(function () {
  const POLL_MS = 2000;
  const RETRY_MS = 5000;
  const FINISHED = ["success", "failed", "skipped", "upstream_failed", "removed"];
  const SVG_NS = "http://www.w3.org/2000/svg";
  const WIDTH = 600;
  const HEIGHT = 220;
  const PAD = { left: 64, right: 14, top: 12, bottom: 28 };

  const body = document.body;
  const root = body.dataset.root || "";
  const $ = (id) => document.getElementById(id);

  // -- theme -------------------------------------------------------------------------------------

  const forcedTheme = (() => {
    const asked = new URLSearchParams(window.location.search).get("theme");
    return asked === "dark" || asked === "light" ? asked : null;
  })();
  const systemDark = window.matchMedia ? window.matchMedia("(prefers-color-scheme: dark)") : null;

  function parentRoot() {
    try {
      if (window.parent !== window) return window.parent.document.documentElement;
    } catch (e) {
      // Another origin: nothing to read there.
    }
    return null;
  }

  function resolveTheme() {
    if (forcedTheme) return forcedTheme;
    const outer = parentRoot();
    if (outer) {
      if (outer.classList.contains("dark")) return "dark";
      if (outer.classList.contains("light")) return "light";
    }
    let stored = null;
    try {
      stored = window.localStorage.getItem("theme");
    } catch (e) {
      stored = null;
    }
    if (stored === "dark" || stored === "light") return stored;
    return systemDark && systemDark.matches ? "dark" : "light";
  }

  // Inside the UI the page is transparent: the UI's own background shows through the iframe (the
  // browser paints it so when both sides have the same color-scheme, as they do once it follows).
  function applyTheme() {
    const page = document.documentElement;
    page.dataset.theme = resolveTheme();
    page.classList.toggle("embedded", Boolean(parentRoot()) && !forcedTheme);
  }

  function followTheme() {
    applyTheme();
    if (forcedTheme) return;
    const outer = parentRoot();
    if (outer && window.MutationObserver) {
      new MutationObserver(applyTheme).observe(outer, { attributes: true, attributeFilter: ["class"] });
    }
    window.addEventListener("storage", (event) => {
      if (event.key === null || event.key === "theme") applyTheme();
    });
    if (systemDark && systemDark.addEventListener) systemDark.addEventListener("change", applyTheme);
  }

  // -- which task instance -----------------------------------------------------------------------

  // <root>/training/<dag_id>/<run_id>/<task_id>[/<map_index>], each segment percent-encoded: kept
  // encoded for the API's address, decoded for display. The UI leaves "{MAP_INDEX}" as is on the
  // page of a task that is not mapped.
  function taskFromPath() {
    const path = window.location.pathname;
    const marker = "/training/";
    const at = path.indexOf(marker);
    const parts = at < 0 ? [] : path.slice(at + marker.length).split("/").filter((p) => p !== "");
    if (parts.length < 3) return null;
    const decode = (segment) => {
      try {
        return decodeURIComponent(segment);
      } catch (e) {
        return segment;
      }
    };
    const mapText = parts.length > 3 ? decode(parts[3]) : "";
    return {
      encoded: parts.slice(0, 3),
      dagId: decode(parts[0]),
      runId: decode(parts[1]),
      taskId: decode(parts[2]),
      mapIndex: /^-?\d+$/.test(mapText) ? parseInt(mapText, 10) : -1,
    };
  }

  // -- formatting --------------------------------------------------------------------------------

  function formatNumber(value) {
    if (value === null || value === undefined) return "–";
    if (Number.isInteger(value)) return String(value);
    const abs = Math.abs(value);
    if (abs !== 0 && (abs < 1e-3 || abs >= 1e6)) return value.toExponential(3);
    return String(Number(value.toPrecision(4)));
  }

  function formatDuration(seconds) {
    if (seconds === null || seconds === undefined) return "–";
    const s = Math.round(seconds);
    if (s < 60) return `${s} s`;
    if (s < 3600) return `${Math.floor(s / 60)} min ${s % 60} s`;
    return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  }

  function progressText(progress, count) {
    if (progress && progress.total_steps) {
      const done = Math.min(progress.step + 1, progress.total_steps);
      const percent = Math.round(progress.fraction * 100);
      return `${done} / ${progress.total_steps} steps (${percent}%)`;
    }
    if (progress && progress.step !== null && progress.step !== undefined) return `step ${progress.step}`;
    return count ? "no total_steps reported" : "no reports yet";
  }

  // -- charts ------------------------------------------------------------------------------------

  function metricNames(points) {
    const names = [];
    for (const point of points) {
      for (const name of Object.keys(point)) {
        if (name !== "step" && name !== "time" && !names.includes(name)) names.push(name);
      }
    }
    return names;
  }

  // An axis from lo to hi with round ticks about `count` apart (1, 2 or 5 times a power of ten, at
  // least `minStep`), widened to the ticks around it.
  function niceAxis(lo, hi, count, minStep) {
    if (lo === hi) {
      const pad = minStep || Math.abs(lo) * 0.1 || 1;
      const low = lo - pad;
      [lo, hi] = [lo >= 0 && low < 0 ? 0 : low, hi + pad];
    }
    const rough = (hi - lo) / count;
    const power = Math.pow(10, Math.floor(Math.log10(rough)));
    const step = Math.max(minStep, [1, 2, 5, 10].map((m) => m * power).find((s) => s >= rough));
    const first = Math.floor(lo / step) * step;
    const last = Math.ceil(hi / step) * step;
    const ticks = [];
    for (let value = first; value <= last + step / 2; value += step) ticks.push(Number(value.toPrecision(12)));
    return { lo: first, hi: last, ticks };
  }

  function svg(tag, attributes, text) {
    const node = document.createElementNS(SVG_NS, tag);
    for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
    if (text !== undefined) node.textContent = text;
    return node;
  }

  function checkpointTitle(mark) {
    const values = Object.entries(mark.metrics || {})
      .filter(([, value]) => typeof value === "number")
      .map(([key, value]) => `${key}=${formatNumber(value)}`);
    return `checkpoint at step ${mark.step}${mark.best ? " (best)" : ""}${values.length ? ": " + values.join(" ") : ""}`;
  }

  function drawChart(name, points, marks) {
    // x is the step; a record without one takes its place in the history.
    const series = [];
    points.forEach((point, index) => {
      const y = point[name];
      if (typeof y === "number" && Number.isFinite(y)) {
        series.push([typeof point.step === "number" ? point.step : index, y]);
      }
    });
    const figure = document.createElement("figure");
    figure.className = "chart";
    figure.dataset.metric = name;
    const caption = document.createElement("figcaption");
    const title = document.createElement("span");
    title.className = "metric-name";
    title.textContent = name;
    const last = document.createElement("span");
    last.className = "last";
    last.textContent = series.length ? formatNumber(series[series.length - 1][1]) : "–";
    caption.append(title, last);
    figure.append(caption);

    const chart = svg("svg", { viewBox: `0 0 ${WIDTH} ${HEIGHT}`, role: "img" });
    chart.append(svg("title", {}, `${name} against step`));
    const xs = series.map((p) => p[0]);
    const ys = series.map((p) => p[1]);
    const xAxis = niceAxis(series.length ? Math.min(...xs) : 0, series.length ? Math.max(...xs) : 1, 6, 1);
    const yAxis = niceAxis(series.length ? Math.min(...ys) : 0, series.length ? Math.max(...ys) : 1, 4, 0);
    const [x0, x1] = [xAxis.lo, xAxis.hi];
    const [y0, y1] = [yAxis.lo, yAxis.hi];
    const innerW = WIDTH - PAD.left - PAD.right;
    const innerH = HEIGHT - PAD.top - PAD.bottom;
    const sx = (x) => PAD.left + ((x - x0) / (x1 - x0)) * innerW;
    const sy = (y) => PAD.top + (1 - (y - y0) / (y1 - y0)) * innerH;

    for (const value of yAxis.ticks) {
      const y = sy(value);
      chart.append(svg("line", { class: "grid", x1: PAD.left, x2: WIDTH - PAD.right, y1: y, y2: y }));
      chart.append(
        svg("text", { class: "axis", x: PAD.left - 6, y: y + 4, "text-anchor": "end" }, formatNumber(value)),
      );
    }
    const axisY = HEIGHT - 8;
    for (const value of xAxis.ticks) {
      chart.append(
        svg("text", { class: "axis", x: sx(value), y: axisY, "text-anchor": "middle" }, formatNumber(value)),
      );
    }
    chart.append(svg("text", { class: "axis", x: PAD.left - 6, y: axisY, "text-anchor": "end" }, "step"));
    // The kept checkpoints (after the run): a dashed line at each one's step, the best one stronger.
    for (const mark of marks || []) {
      if (typeof mark.step !== "number" || mark.step < x0 || mark.step > x1) continue;
      const x = sx(mark.step).toFixed(1);
      const line = svg("line", {
        class: mark.best ? "checkpoint best" : "checkpoint",
        x1: x,
        x2: x,
        y1: PAD.top,
        y2: HEIGHT - PAD.bottom,
        "data-step": mark.step,
      });
      line.append(svg("title", {}, checkpointTitle(mark)));
      chart.append(line);
    }
    const coordinates = series.map(([x, y]) => `${sx(x).toFixed(1)},${sy(y).toFixed(1)}`).join(" ");
    chart.append(
      svg("polyline", {
        class: "curve",
        points: coordinates,
        "data-metric": name,
        "data-points": series.length,
      }),
    );
    if (series.length) {
      const [x, y] = series[series.length - 1];
      chart.append(svg("circle", { class: "dot", cx: sx(x).toFixed(1), cy: sy(y).toFixed(1), r: 3 }));
    }
    figure.append(chart);
    return figure;
  }

  // -- the page ----------------------------------------------------------------------------------

  function renderRanks(ranks) {
    // Each rank's step time and compute share, which the run adds to its metrics at the end.
    const rows = (ranks || []).map((rank) => {
      const row = document.createElement("tr");
      row.dataset.rank = String(rank.rank);
      const share = typeof rank.compute_share === "number" ? `${Math.round(rank.compute_share * 100)}%` : "–";
      const mean = typeof rank.mean_step_time_s === "number" ? `${formatNumber(rank.mean_step_time_s)} s` : "–";
      const rate = typeof rank.steps_per_s === "number" ? formatNumber(rank.steps_per_s) : "–";
      for (const text of [String(rank.rank), mean, rate, share]) {
        const cell = document.createElement("td");
        cell.textContent = text;
        row.append(cell);
      }
      return row;
    });
    $("rank-rows").replaceChildren(...rows);
    $("ranks").hidden = !rows.length;
  }

  function showMessage(text) {
    const message = $("message");
    message.textContent = text || "";
    message.hidden = !text;
  }

  function render(data) {
    const points = data.metrics || [];
    const progress = data.progress || {};
    const state = data.state || "none";
    $("state").textContent = state.replace(/_/g, " ");
    $("state").dataset.state = state;
    $("progress-text").textContent = progressText(progress, points.length);
    $("eta-text").textContent =
      progress.eta_seconds === 0 && progress.fraction >= 1 ? "done" : formatDuration(progress.eta_seconds);
    $("world-size").textContent = data.world_size === null || data.world_size === undefined ? "–" : String(data.world_size);
    $("report-count").textContent = String(points.length);
    // The task's MLflow run (mlflow_conn_id), an http(s) page only: never a javascript: URL.
    const mlflow = /^https?:\/\//.test(data.mlflow_run_url || "") ? data.mlflow_run_url : "";
    $("mlflow-link").hidden = !mlflow;
    if (mlflow) $("mlflow-link").href = mlflow;
    const percent = progress.fraction === null || progress.fraction === undefined ? 0 : progress.fraction * 100;
    $("progress-bar").style.width = `${percent}%`;
    $("progress-bar").parentElement.setAttribute("aria-valuenow", String(Math.round(percent)));
    const charts = $("charts");
    charts.replaceChildren(...metricNames(points).map((name) => drawChart(name, points, data.checkpoints)));
    renderRanks(data.ranks);
    showMessage(points.length ? "" : "No metrics reported yet: training code calls report(step=..., loss=...).");
    body.dataset.state = state;
    body.dataset.source = data.source || "";
    body.dataset.loaded = "true";
  }

  async function poll(url) {
    let response;
    try {
      response = await fetch(url, { credentials: "same-origin", headers: { Accept: "application/json" } });
    } catch (error) {
      showMessage(`Cannot reach the Airflow API server (${error}); trying again.`);
      window.setTimeout(() => poll(url), RETRY_MS);
      return;
    }
    if (response.status === 401 || response.status === 403 || response.status === 404) {
      const reasons = {
        401: "Not signed in to Airflow: open this view from the Airflow UI.",
        403: "You may not read this DAG's task instances.",
        404: "There is no such task instance.",
      };
      body.dataset.error = String(response.status);
      showMessage(reasons[response.status]);
      return;
    }
    if (!response.ok) {
      showMessage(`The Airflow API server answered ${response.status}; trying again.`);
      window.setTimeout(() => poll(url), RETRY_MS);
      return;
    }
    const data = await response.json();
    if (data.training_task === false) {
      // Airflow shows the tab on every task: say plainly that this one has nothing to show.
      $("state").textContent = "not a training task";
      $("state").dataset.state = "none";
      document.querySelector(".figures").hidden = true;
      $("progress-bar").parentElement.hidden = true;
      $("charts").replaceChildren();
      body.dataset.error = "not-training";
      showMessage(data.message);
      return;
    }
    render(data);
    if (!FINISHED.includes(data.state)) window.setTimeout(() => poll(url), POLL_MS);
  }

  followTheme();
  const task = taskFromPath();
  if (!task) {
    showMessage("This page shows one task instance: <root>/training/<dag_id>/<run_id>/<task_id>.");
    return;
  }
  $("task").textContent = `Training · ${task.taskId}${task.mapIndex >= 0 ? ` [${task.mapIndex}]` : ""}`;
  document.title = `Training · ${task.dagId} · ${task.taskId}`;
  const url = `${root}/api/runs/${task.encoded.join("/")}?map_index=${task.mapIndex}`;
  poll(url);
})();
