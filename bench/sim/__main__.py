"""`python -m bench.sim`: the simulated fleet.

python -m bench.sim --validate          # simulated vs measured (CPU fleet study, Qwen3-32B case)
python -m bench.sim --validate --run RUN.json --grid GRID.json --steps OTHER_RUN.json   # any day's
python -m bench.sim --project           # GPU projections (8-64 GPUs), table and plot
python -m bench.sim --project --reads measured-rate   # the same, NIXL reads as measured elsewhere
python -m bench.sim --params            # every parameter with its source
python -m bench.sim --jitter results/fleet.json   # the serving path's ITL jitter in a study's run
python -m bench.sim --study --level-sessions 3 [--cores 0]   # the fleet study's dp, default, bidir-pd
python -m bench.sim --study --profile fleet-32k              # the same with histories to 32k
python -m bench.sim --trace FILE.jsonl --mode bidir --hardware h200 --decode 2   # one trace
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from bench import settings
from bench.sim.costs import read_grid
from bench.sim.fleet import MODES, Fleet, FleetSpec
from bench.sim.params import cpu_fleet, gpu_qwen3_32b
from bench.sim.study import level_figures
from bench.traces import read_trace


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.sim", description=__doc__)
    p.add_argument("--validate", action="store_true", help="simulated vs measured tables")
    p.add_argument("--project", action="store_true", help="GPU projections, markdown table and plot")
    p.add_argument("--params", action="store_true", help="every parameter and its source")
    p.add_argument("--sensitivity", action="store_true", help="which figure each GPU parameter moves most")
    p.add_argument(
        "--study", action="store_true", help="the CPU fleet study's dp, default and bidir-pd, each ramped"
    )
    p.add_argument(
        "--profile", default="fleet", choices=("fleet", "fleet-32k"), help="--study: the workload, as bench's"
    )
    p.add_argument("--level-sessions", type=int, default=1, help="--study: sessions per agent, as bench's")
    p.add_argument(
        "--cores",
        type=float,
        help="--study: cores the engines share with the serving processes (default: the VM's 2; 0: none)",
    )
    p.add_argument(
        "--transfer",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="--study, --project, --trace: one of the app's transfer.* settings, as bench's (repeatable)",
    )
    p.add_argument(
        "--jitter",
        metavar="FILE",
        help="the serving path's ITL jitter in a fleet study's results (bench --out), for --jitter-mode "
        "at --jitter-agents",
    )
    p.add_argument("--jitter-mode", default="bidir-pd")
    p.add_argument("--jitter-agents", default="4")
    p.add_argument(
        "--run",
        metavar="FILE",
        help="--validate against this fleet study's results (bench --out) instead of the docs' run",
    )
    p.add_argument(
        "--grid",
        metavar="FILE",
        help="--validate, --study: the CPU engine fitted on this bench.prefill_cost --grid file "
        "(the VM and day of --run) instead of the docs' grid",
    )
    p.add_argument(
        "--steps",
        metavar="FILE",
        help="--validate: the engines' step waits fitted on this fleet study's results (bench --out; "
        "another run than --run, beside the same grid)",
    )
    p.add_argument("--trace", help="a JSONL trace (bench.traces format) to run on one fleet")
    p.add_argument("--mode", default="bidir", choices=MODES)
    p.add_argument("--hardware", default="cpu", choices=("cpu", "h200", "h100"))
    p.add_argument("--prefill", type=int, default=1, help="prefill engines")
    p.add_argument("--decode", type=int, default=1, help="decode engines (dp: all engines)")
    p.add_argument(
        "--plot",
        help="where --project writes its plot (default: docs/bench-sim.png; with --reads, "
        "results/bench-sim-READS.png)",
    )
    p.add_argument(
        "--ttft-p90", type=float, help="--project's TTFT p90 target in s (default: the fleet study's)"
    )
    p.add_argument(
        "--reads",
        default="line-rate-handoff",
        help="--project: NIXL reads at EFA's line rate plus vLLM RFC #50913's hand-off "
        "(line-rate-handoff, the default), the transfer alone (line-rate), as that RFC measured "
        "them on another cluster (measured-rate, measured-handoff), or MS:GBPS, your own: a fixed "
        "cost per read and one GPU's rate (`bench.sim.published.read_cost`)",
    )
    p.add_argument("--out", help="write the figures as JSON here")
    args = p.parse_args(argv)
    started = time.perf_counter()
    out: dict = {}
    if args.params:
        from bench.sim.published import fit_mfu

        for hw in (cpu_fleet(), gpu_qwen3_32b(tp=2, mfu=fit_mfu())):
            print(f"\n{hw.name}:\n\n| parameter | value | source | moves most |\n| --- | --- | --- | --- |")
            for prm in hw.params:
                print(f"| {prm.name} | {prm.value} | {prm.source} | {prm.moves} |")
    if args.validate:
        from bench.profiles import profile
        from bench.sim import published, reference, validate

        assert (shape := profile("fleet").trace) is not None
        levels: list[dict] = []
        ref = reference.read_reference(args.run) if args.run else reference.DOCS_RUN
        hw = cpu_fleet(read_grid(args.grid) if args.grid else None)
        if args.steps:
            from bench.sim import stepwait

            waits = stepwait.fit(args.steps, shape, hw)
            print(stepwait.format_fit(waits) + "\n")
            hw = waits.apply(hw)
            out["step_waits"] = {"dp_s": waits.plain_s, "pd_s": waits.nixl_s, "rows": waits.rows}
        hops: list[dict] = []
        rows = validate.cpu_table(shape, hw, levels_out=levels, ref=ref, hops_out=hops)
        gpu = published.gpu_case()
        print(validate.format_report(rows, gpu, ref))
        print("\n" + validate.format_levels(levels))
        for table in (validate.format_steps(levels), validate.format_hops(hops)):
            if table:
                print("\n" + table)
        out["validate"] = {"cpu": rows, "levels": levels, "gpu": gpu, "hops": hops}
    if args.project:
        from bench.fleet import SLO
        from bench.sim import project, published

        try:
            measured = (
                None
                if args.reads == published.DEFAULT_READS
                else published.with_reads(args.reads, project.TP)
            )
        except ValueError as e:
            p.error(str(e))
        result = project.run(
            hw=measured,
            slo=SLO(ttft_p90_s=args.ttft_p90) if args.ttft_p90 else None,
            transfer=tuple(sorted(settings(args.transfer, "--transfer").items())),
        )
        print(project.format_table(result))
        plot = args.plot or (
            "docs/bench-sim.png"
            if measured is None
            else f"results/bench-sim-{args.reads.replace(':', '-')}.png"
        )
        project.plot(result, plot)
        print(f"plot: {plot}")
        out["project"] = result
    if args.sensitivity:
        from bench.profiles import profile
        from bench.sim import project
        from bench.sim import validate as check

        assert (fleet_shape := profile("fleet").trace) is not None
        cpu_rows = check.cpu_sensitivity(fleet_shape)
        print(check.format_cpu_sensitivity(cpu_rows) + "\n")
        sens = project.sensitivity()
        print(project.format_sensitivity(sens))
        out["sensitivity"] = {"cpu": cpu_rows, "gpu": sens}
    if args.study:
        from dataclasses import replace

        from bench.fleet import LEVELS
        from bench.profiles import profile
        from bench.sim import study

        prof = profile(args.profile)
        assert prof.trace is not None
        hw = cpu_fleet(read_grid(args.grid) if args.grid else None)
        hw = hw if args.cores is None else replace(hw, cores=args.cores)
        if prof.kv_cache_bytes:  # the fleet-32k profile gives its engines twice the fleet's KV
            hw = replace(hw, kv_blocks=prof.kv_cache_bytes // (hw.kv_bytes_per_token * hw.block_size))
        transfer = settings(args.transfer, "--transfer")
        compared = study.compare(hw, prof.trace, args.level_sessions, LEVELS[args.profile], transfer)
        print(study.format_compare(compared))
        out["study"] = {
            "profile": args.profile,
            "cores": hw.cores,
            "sessions_per_agent": args.level_sessions,
            "transfer": transfer,
            "modes": compared,
        }
    if args.jitter:
        from bench.sim.costs import jitter_of

        with open(args.jitter) as f:
            records = json.load(f)["modes"][args.jitter_mode]["records"][args.jitter_agents]
        jitter = jitter_of([r["itl_s"] for r in records if r.get("ok")])
        print(f"ITL jitter ({args.jitter_mode} at {args.jitter_agents} agents): (ratio, share)")
        print(jitter)
        out["jitter"] = jitter
    if args.trace:
        hw = cpu_fleet() if args.hardware == "cpu" else gpu_qwen3_32b(tp=2, gpu=args.hardware)
        changed = tuple(sorted(settings(args.transfer, "--transfer").items()))
        fleet = Fleet(FleetSpec(args.mode, hw, prefill=args.prefill, decode=args.decode, transfer=changed))
        figures = level_figures(fleet.run(read_trace(args.trace)), _slo())
        print(json.dumps(figures, indent=2, default=str))
        out["trace"] = figures
    if not out and not args.params:  # nothing asked
        p.print_help()
        return 2
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2, default=str)
    print(f"\n({time.perf_counter() - started:.1f} s)", file=sys.stderr)
    return 0


def _slo():
    from bench.fleet import SLO

    return SLO()


if __name__ == "__main__":
    sys.exit(main())
