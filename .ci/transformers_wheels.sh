#!/usr/bin/env bash
# The [transformers] extra for a machine without a package index (the GPU machine): transformers and the
# dependencies its import needs beyond torch's own (torch brings filelock, fsspec, typing_extensions, jinja2,
# sympy, networkx; numpy is assumed present), as wheel files in wheels/ (git-ignored; about 25 MB). Compiled ones
# for CPython 3.10 to 3.13 on manylinux x86_64. On the offline machine:
#   pip install --no-index --no-deps --find-links wheels $(cat wheels/NAMES)
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p wheels
pure=(transformers==5.25.0 huggingface_hub==2.4.0 tqdm packaging httpx2 httpcore2 h11 idna truststore)
python -m pip download --no-deps -q -d wheels "${pure[@]}"
for v in 3.10 3.11 3.12 3.13; do
  for pkg in regex pyyaml safetensors tokenizers; do
    python -m pip download --no-deps -q -d wheels --only-binary=:all: --python-version "$v" \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 "$pkg"
  done
done
echo "transformers huggingface_hub safetensors tokenizers regex pyyaml tqdm packaging httpx2 httpcore2 h11 idna" \
  "truststore" > wheels/NAMES
du -sh wheels
