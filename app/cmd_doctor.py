"""`mtpchat doctor [--json] [--model M] [--device D]`: what this machine offers and what mtpchat would do on it:
devices and memory, package versions, the backend of each op (with the FLA self-check), compile / graph
capability, the discovered models, the one that would be picked and why, and every fallback in force."""

from __future__ import annotations

import argparse
import json

from .cmd_models import settings_model
from .safe_text import single_line

PROG = "mtpchat doctor"


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "doctor",
        help="diagnostics: devices, packages, kernels, models, what would be picked and why",
        description="Report the device, package versions, the kernel backend per op, compile / CUDA-graph "
                    "capability, the discovered models, the one that would be picked and every fallback in force.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", default=None, metavar="M",
                   help="a model name or folder to check instead of the automatic pick")
    p.add_argument("--device", default=None, metavar="D", help="auto (default), cpu, cuda or cuda:N")
    return p


def _error(msg: str) -> None:
    from .cli import print_error

    print_error(msg, PROG)


def run(args: argparse.Namespace) -> int:
    from .cli import one_line_errors

    return one_line_errors(_run, args, PROG)


def backends_for(device) -> dict[str, dict]:
    """op -> {"backend", "reason"}: the engine's own selection when it can be asked, else the environment's plan."""
    from engine import OPS, backend_plan

    plan = backend_plan(device)
    try:
        import torch

        from engine import select_backends

        chosen = select_backends(torch.device(device.torch_device)).choice
        engine_plan = {op: {"backend": b, "reason": r} for op, (b, r) in chosen.items()}
    except Exception:  # the kernel module is optional here: fall back to the environment's view
        engine_plan = {}
    return {op: engine_plan.get(op, plan.get(op)) for op in (*OPS, *[o for o in engine_plan if o not in OPS])}


def collect(model: str | None = None, device_request: str | None = None) -> dict:
    """The whole report as a JSON-ready dict. Raises DeviceUnavailable for a bad `device_request`."""
    from engine import (choose, compile_capability, discover, fallbacks_for, fla_status, list_devices,
                        package_versions, probe_device, visible_gpus)

    device = probe_device(device_request)
    pinned, pinned_from = (model, "--model") if model else (settings_model(), "settings")
    candidates = discover(device=device)
    choice = choose(candidates, device, pinned=pinned, gpus=visible_gpus(device))
    usable, why = fla_status(device)
    return {
        "device": device.to_json(),
        "devices": [d.to_json() for d in list_devices()],
        "versions": package_versions(),
        "fla": {"usable": usable, "reason": why},
        "backends": backends_for(device),
        "compile": compile_capability(device),
        "models": [c.to_json() for c in candidates],
        "choice": {**choice.to_json(), "pinned": pinned, "pinned_from": pinned_from if pinned else None},
        "fallbacks": fallbacks_for(device, choice.candidate),
    }


def _run(args: argparse.Namespace) -> int:
    from engine import DeviceUnavailable

    from .cli import write_out

    model = getattr(args, "model", None)
    try:
        report = collect(model, getattr(args, "device", None))
    except DeviceUnavailable as e:
        _error(str(e))
        return 2
    if getattr(args, "json", False):
        write_out(json.dumps(report, indent=2) + "\n")
    else:
        write_out(render(report) + "\n")
    # A model asked for on the command line that cannot be used is a failure; everything else is information.
    return 1 if model and report["choice"]["pinned_error"] else 0


def terminal_safe_report(value):
    """The report with every string terminal-safe and on one line: names, paths and reasons come from folder
    names and files (the JSON report keeps them as they are: json.dumps escapes control characters)."""
    if isinstance(value, str):
        return single_line(value)
    if isinstance(value, dict):
        return {k: terminal_safe_report(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [terminal_safe_report(v) for v in value]
    return value


def render(r: dict) -> str:
    from engine import fit_text, format_bytes, format_params

    r = terminal_safe_report(r)
    out: list[str] = []
    sel = r["device"]["device"]
    out.append("Devices")
    for d in r["devices"]:
        mark = "*" if d["device"] == sel else " "
        extra = f", compute {d['capability']}" if d.get("capability") else ""
        out.append(f"  {mark} {d['device']:<7} {d['name']}{extra}: {format_bytes(d['free_bytes'])} free of "
                   f"{format_bytes(d['total_bytes'])}")
    v = r["versions"]
    out += ["", "Packages"]
    for key in ("python", "torch", "cuda", "transformers", "fla", "triton", "textual", "huggingface_hub",
                "safetensors"):
        missing = "none" if key == "cuda" else "not installed"
        out.append(f"  {key:<16}{v.get(key) or missing}")
    out += ["", "Kernels", f"  FLA: {'usable' if r['fla']['usable'] else 'not used'} ({r['fla']['reason']})"]
    width = max((len(b["backend"]) for b in r["backends"].values()), default=0) + 2
    for op, b in r["backends"].items():
        out.append(f"  {op:<16}{b['backend']:<{width}}{b['reason']}")
    c = r["compile"]
    out += ["", "Compile / graphs",
            f"  CUDA available: {'yes' if c['cuda_available'] else 'no'}; torch.compile: "
            f"{'present' if c['torch_compile'] else 'absent'}; triton: {'present' if c['triton'] else 'absent'}; "
            f"CUDA graphs: {'possible' if c['cuda_graphs'] else 'not possible'} (capability only; the engine "
            f"certifies capture at run time)"]
    out += ["", f"Models ({len(r['models'])} found)"]
    picked = r["choice"]["path"]
    for m in r["models"]:
        mark = "*" if m["path"] == picked else " "
        status = "ok" if m["supported"] else f"unsupported: {m['reason']}"
        mtp = f"MTP x{m['mtp_layers']}" if m["mtp_layers"] else "no MTP"
        out.append(f"  {mark} {m['name']} [{m['source']}] {m['family'] or '?'}, {format_params(m['params'])} "
                   f"params, {mtp}, needs {format_bytes(m['mem_bytes'])}, "
                   f"{'fits' if m['fits_device'] else 'does not fit'}, "
                   f"context fits: {fit_text(m['context_fits'], m['context_limit'])}; {status}")
        out.append(f"      {m['path']}")
        if m.get("drafts"):
            out.append(f"      draft models (--draft-model): {', '.join(m['drafts'])}")
    ch = r["choice"]
    out += ["", "Choice"]
    if ch["pinned"]:
        out.append(f"  pinned ({ch['pinned_from']}): {ch['pinned']}")
    out.append(f"  {ch['reason']}" if ch["name"] else f"  none: {ch['reason']}")
    out += ["", "Fallbacks in force"]
    out += [f"  - {f['feature']}: {f['reason']}" for f in r["fallbacks"]] or ["  none"]
    return "\n".join(out)
