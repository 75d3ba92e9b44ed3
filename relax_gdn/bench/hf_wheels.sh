#!/usr/bin/env bash
# The transformers / peft / liger-kernel wheels for the offline GPU host (the HF export and LoRA GPU
# tests, the Hugging Face rows of `python -m relax_gdn.bench.peers`), at the
# versions of requirements.lock, into .gpu-hf/ (git-ignored; ~25 MiB, one transfer of its own since
# the .gpu bundle takes 47 of a call's 64 MiB). The machine keeps it between calls while it stays warm.
#
#   relax_gdn/bench/hf_wheels.sh                  here: download the wheels and write .gpu-hf/activate.sh
#   source .gpu/activate.sh && source .gpu-hf/activate.sh     on the GPU host
set -euo pipefail
dest=${1:-.gpu-hf}
lock=$(dirname "$0")/../../requirements.lock
# transformers, peft, liger-kernel and what they import that the host's torch image and the .gpu bundle lack
names=(transformers tokenizers huggingface_hub peft liger-kernel accelerate regex tqdm filelock fsspec hf-xet requests
       certifi charset-normalizer idna urllib3 httpx2 httpcore2 anyio sniffio h11 truststore typer click
       shellingham annotated-doc)
pins=()
for name in "${names[@]}"; do
  pin=$(grep -i -E "^${name//[-_]/[-_]}==" "$lock") || { echo "hf_wheels: $name is not in $lock" >&2; exit 1; }
  pins+=("$pin")
done
mkdir -p "$dest"
python3 -m pip download -q --no-deps --python-version 3.12 --implementation cp --only-binary=:all: \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" "${pins[@]}"
cat > "$dest/activate.sh" <<'ACTIVATE'
# source me on the GPU host after .gpu/activate.sh: installs the wheels into /tmp/site-hf once and
# appends it to PYTHONPATH
_hf=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
if [[ ! -f /tmp/site-hf/.bundle-ok ]]; then
  mkdir -p /tmp/site-hf
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site-hf "$_hf"/*.whl && touch /tmp/site-hf/.bundle-ok
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}/tmp/site-hf
ACTIVATE
du -sh "$dest"
