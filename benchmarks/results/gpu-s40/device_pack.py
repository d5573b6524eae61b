# The trained drafters in bf16 (as the releases ship), with their run records, into one folder to tar up.
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
runs, out = Path(sys.argv[1]), Path(sys.argv[2])
for name in sys.argv[3:] or ("a", "b"):  # the runs to pack (session 42: one, "r18")
    src = runs / name
    if not (src / "final" / "model.safetensors").is_file():
        print(f"{name}: no final/ (see {name}.log)"); continue
    dst = out / name; dst.mkdir(parents=True, exist_ok=True)
    for which in ("final", "best"):
        if not (src / which / "model.safetensors").is_file():
            continue
        d = dst / which; d.mkdir(exist_ok=True)
        sd = load_file(str(src / which / "model.safetensors"))
        save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in sd.items()},
                  str(d / "model.safetensors"))
        for f in ("config.json", "best.json"):
            if (src / which / f).is_file(): shutil.copy(src / which / f, d / f)
        if which == "best":
            best = json.loads((src / "best" / "best.json").read_text())["step"]
            final = json.loads((src / "run.json").read_text()).get("summary", {}).get("steps")
            if best in (0, final): shutil.rmtree(d); print(f"{name}: best is step {best} (final {final}): not kept")
    for f in ("run.json", "metrics.jsonl", "training.png"):
        if (src / f).is_file(): shutil.copy(src / f, dst / f)
print(sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()))
