"""Render ``bench/results/latest.json`` as the README's benchmark section (between the markers).

``python bench/report.py`` re-renders it; every benchmark script calls :func:`render_readme` after
writing its section. Hand-written findings in ``bench/notes.md``, if present, are appended.
"""

from __future__ import annotations

import statistics
from typing import Any

from common import BENCH, REPO, load_results

START, END = "<!-- bench:start -->", "<!-- bench:end -->"
NOTES = BENCH / "notes.md"


def render_readme() -> None:
    """Replace the text between the markers in README.md (appending the markers when absent)."""
    readme = REPO / "README.md"
    text = readme.read_text()
    if START not in text or END not in text:
        text = text.rstrip("\n") + f"\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{START}\n{render(load_results())}\n{END}{tail}")


def _s(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def _verdict(met: bool | None) -> str:
    return "–" if met is None else ("met" if met else "**missed**")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(r) + " |" for r in rows]
    return out


def _load(samples: list[dict[str, Any]]) -> str:
    """Median 1-minute load average before the samples."""
    loads = [s["load_before"][0] for s in samples if s.get("load_before")]
    return _s(statistics.median(loads)) if loads else "–"


def _machine(results: dict[str, Any]) -> list[str]:
    machine = next(
        (sec["machine"] for sec in results.values() if isinstance(sec, dict) and "machine" in sec), None
    )
    if not machine:
        return []
    v = machine["versions"]
    return [
        f"Measured {machine['date']} on {machine['nproc']} x {machine['cpu_model']}, {machine['mem_gib']} GiB RAM, "
        f"Linux {machine['kernel']}, Python {machine['python']}, {machine['java']}, torch {v['torch']}, "
        f"pyspark {v['pyspark']}, Airflow {v['apache-airflow']}. The machine was shared: other people ran test "
        "suites (Spark, torchrun) at the same time, so the 1-minute load average is given with each "
        "measurement (2 cores: load 2 means fully busy), variants run interleaved (A B C ... A B C ...) after an "
        "uncounted warm-up round, and medians are reported. Raw samples: `bench/results/latest.json`.",
        "",
    ]


def _launch(sec: dict[str, Any]) -> list[str]:
    stats, samples = sec["stats"], sec["samples"]
    lines = [
        "### Launch overhead",
        "",
        f"The trivial 2-rank gloo DDP function (`bench/workloads/ddp_trivial.py`: init, one allreduce, 3 DDP steps "
        f"on a 4x1 model, destroy), each sample a fresh process tree timed from fork to exit; {sec['rounds']} "
        "counted rounds. `python bench/launch.py [--rounds 3] [--quick]`.",
        "",
    ]
    rows = []
    for name, label in sec["variants"].items():
        st = stats[name]
        rows.append(
            [
                label,
                _s(st["median_s"]),
                _s(st["min_s"]),
                _s(st["max_s"]),
                f"{st['n_ok']}/{st['n']}",
                _load(samples[name]),
            ]
        )
    lines += _table(["launcher", "median s", "min s", "max s", "ok", "load"], rows)
    lines += ["", "Ratios of medians:", ""]
    rows = []
    for r in sec["ratios"]:
        target = "–" if r["target"] is None else f"<= {r['target']}"
        rows.append([f"{r['numerator']} / {r['denominator']}", _s(r["ratio"]), target, _verdict(r["met"])])
    lines += _table(["ratio", "value", "target", ""], rows)
    return lines + [""]


def _profile(sec: dict[str, Any]) -> list[str]:
    meds = sec["medians"]
    lines = [
        "### Where a launch's time goes",
        "",
        "`python bench/profile_launch.py`: the hook run by `bench/workloads/hook_traced.py`, instrumented from "
        "outside the package (a traced driver script swapped in at staging, wrappers pickled into the barrier "
        "tasks, spark-submit's lines time-stamped as they arrive, a psutil sampler for process starts/exits). "
        f"Consecutive phases, medians of {sec['rounds']} runs each (phases are medians, so they need not add "
        "up exactly to the total).",
        "",
    ]
    for mode in ("distributed", "local"):
        if mode not in meds:
            continue
        rows = [[p["label"], _s(meds[mode].get(p["key"]))] for p in sec["phases"][mode]]
        rows.append(
            ["**total (hook process start to `hook.run` returning)**", f"**{_s(meds[mode]['total'])}**"]
        )
        lines += [f"{mode.capitalize()} mode (load {'/'.join(_s(x) for x in meds[mode]['load1'])}):", ""]
        lines += _table(["phase", "median s"], rows) + [""]
    extra = [k for k in meds if k not in ("distributed", "local")]
    if extra:
        lines += [
            "Settings passed through the hook's `conf`/`env_vars` (no package change), same instrumentation:",
            "",
        ]
        rows = []
        for name in ["distributed", *extra]:
            v = sec["variants"].get(name, {})
            what = (
                ", ".join(f"`{k}={val}`" for k, val in {**v.get("conf", {}), **v.get("env", {})}.items())
                or "defaults"
            )
            m = meds[name]
            rows.append(
                [
                    name,
                    what.replace("|", "\\|"),
                    _s(m.get("jvm_to_driver")),
                    _s(m.get("sc_init")),
                    _s(m.get("total")),
                    "/".join(_s(x) for x in m["load1"]),
                ]
            )
        lines += _table(
            ["variant", "settings", "JVM to driver s", "SparkContext s", "total s", "load"], rows
        ) + [""]
    return lines


def _throughput(sec: dict[str, Any]) -> list[str]:
    lines = [
        "### Training throughput",
        "",
        "`python bench/throughput.py`: a 4-layer MLP (256-256-256-256-10, batch 128, synthetic data), 2 ranks, gloo "
        "DDP; the function times 5 windows of 60 steps after 30 warm-up steps and returns the median window "
        "(rank 0) with the thread settings the rank saw.",
        "",
    ]
    rows = []
    for name, st in sec["stats"].items():
        r = sec["ratios"].get(name)
        rows.append(
            [
                name,
                _s(st["median_steps_per_s"], 1),
                _s(st["max_steps_per_s"], 1),
                ",".join(st["omp_num_threads_env"]),
                ",".join(str(x) for x in st["torch_num_threads"]),
                _s(r["ratio"]) if r else "1.00",
                f">= {r['target']} {_verdict(r['met'])}" if r else "–",
                _load(sec["samples"][name]),
            ]
        )
    lines += _table(
        [
            "launcher",
            "median steps/s",
            "best",
            "OMP_NUM_THREADS",
            "torch threads",
            "vs torchrun",
            "target",
            "load",
        ],
        rows,
    )
    return lines + [""]


def _failure(sec: dict[str, Any]) -> list[str]:
    lines = [
        "### Failure latency",
        "",
        "`python bench/failure_latency.py`: rank 1 writes `time.time()` and raises while rank 0 waits in a "
        "barrier; measured until `hook.run` raises `TrainingFailed` in the caller (spark-submit and all its "
        "processes gone).",
        "",
    ]
    rows = [
        [
            mode,
            _s(st["median_s"]),
            _s(st["max_s"]),
            f"<= {st['target_s']} {_verdict(st['met'])}",
            _load(sec["samples"][mode]),
        ]
        for mode, st in sec["stats"].items()
    ]
    return lines + _table(["mode", "median s", "max s", "target", "load"], rows) + [""]


def _output(sec: dict[str, Any]) -> list[str]:
    lines = [
        "### Output round trip",
        "",
        f"`python bench/output_roundtrip.py`: rank 0 returns a {sec['mb']} MiB state_dict (10 float32 tensors). "
        "Data path = rank 0's `return` until the driver has written the value (output file mtime) + "
        "`to_xcom(pickled)` + `load_output(...)` in the caller; baseline = `torch.save` in rank 0 + `torch.load` "
        "in the caller (local disk, page cache). End to end = from rank 0's return/save until the caller holds "
        "the object, launch tail included. Peak RSS (`VmHWM`) is above the same process in a run with an "
        "empty output, in multiples of the output size.",
        "",
    ]
    rows = []
    for mode, st in sec["stats"].items():
        rows.append(
            [
                mode,
                f"{_s(st['data_path_s'])} (rank→driver {_s(st['rank_to_driver_s'])}, to_xcom {_s(st['to_xcom_s'])}, "
                f"load_output {_s(st['load_output_s'])})",
                _s(st["save_plus_load_s"]),
                f"{_s(st['data_ratio'])} {_verdict(st['time_met'])}",
                _s(st["e2e_ratio"]),
                f"{_s(st['rank0_rss_over_output'])} {_verdict(st['rank_rss_met'])} (save: {_s(st['rank0_rss_over_output_save'])})",
                f"{_s(st['caller_rss_over_output'])} {_verdict(st['caller_rss_met'])} (load: {_s(st['caller_rss_over_output_save'])})",
            ]
        )
    lines += _table(
        [
            "mode",
            "data path s",
            "save+load s",
            "ratio (<= 2)",
            "end-to-end ratio",
            "rank 0 peak RSS / output (<= 2.5)",
            "caller peak RSS / output (<= 2.5)",
        ],
        rows,
    )
    st = next(iter(sec["stats"].values()), {})
    if st:
        lines += [
            "",
            f"The XCom value (base64 envelope) is {_s(st['xcom_json_mib'], 1)} MiB of JSON for the {_s(st['output_mib'], 0)} MiB output.",
        ]
    return lines + [""]


def render(results: dict[str, Any]) -> str:
    """The whole section as markdown."""
    lines = ["## Benchmarks", ""]
    lines += _machine(results)
    for key, fn in (
        ("launch", _launch),
        ("profile", _profile),
        ("throughput", _throughput),
        ("failure_latency", _failure),
        ("output_roundtrip", _output),
    ):
        if key in results:
            lines += fn(results[key])
    if NOTES.exists():
        lines += [NOTES.read_text().strip(), ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    render_readme()
