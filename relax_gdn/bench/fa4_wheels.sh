#!/usr/bin/env bash
# FlashAttention-4 (flash-attn-4 4.0.0b36, CuTe DSL kernels; SM90 forward and backward at head dim
# 256 with varlen and GQA) for the offline GPU host, in parts small enough for one transfer each.
#
#   relax_gdn/bench/fa4_wheels.sh pack       here: download the wheels, unpack them, xz them into
#                                            parts of <= 60 MiB under .gpu-extra/fa4/ (git-ignored)
#   relax_gdn/bench/fa4_wheels.sh install    on the GPU host, once every part has been carried there:
#                                            verify, unpack into /tmp/site-fa4, keep the host's own
#                                            copies of shared dependencies, check the import
#   eval "$(relax_gdn/bench/fa4_wheels.sh env)"   the PYTHONPATH that makes it importable
#
# The xz'd set is ~75 MB: part-0 60 MiB, part-1 ~12 MiB. The parts travel in separate device calls
# (each call carries at most 64 MiB with the working tree's ~3.4 MiB; the .gpu bundle is ~50 MiB), in
# either order: part-1 and SHA256SUMS with .gpu-hf (or alone), part-0 alone; the machine keeps
# what earlier calls brought while it stays warm. apache-tvm-ffi and torch-c-dlpack-ext, which FA4
# also needs, are in the .gpu bundle already (make-bundle.sh pins them).
set -euo pipefail
dest=${FA4_PARTS:-.gpu-extra/fa4}
site=${FA4_SITE:-/tmp/site-fa4}
part_mib=${FA4_PART_MIB:-60}
wheels=(flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1
        nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5
        einops==0.8.2 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 protobuf==7.36.2)
py=(--python-version 3.12 --implementation cp --only-binary=:all:
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)

pack() {
  local tmp; tmp=$(mktemp -d); trap 'rm -rf "$tmp"' RETURN
  python3 -m pip download -q --no-deps "${py[@]}" -d "$tmp/wheels" "${wheels[@]}"
  mkdir -p "$tmp/site" "$dest"
  for w in "$tmp"/wheels/*.whl; do unzip -q -o "$w" -d "$tmp/site"; done
  rm -f "$dest"/fa4.tar.xz.part-* "$dest/SHA256SUMS"
  tar -C "$tmp/site" -cf - . | xz -T0 -6 | split -b "${part_mib}M" -d -a 1 - "$dest/fa4.tar.xz.part-"
  (cd "$dest" && sha256sum fa4.tar.xz.part-* > SHA256SUMS)
  ls -l "$dest"
  du -sh "$tmp/wheels"
}

install() {
  if [[ -f $site/.fa4-ok ]]; then echo "FA4 already installed in $site"; return 0; fi
  if [[ ! -f $dest/SHA256SUMS ]]; then echo "FA4: no $dest/SHA256SUMS here: not carried"; return 1; fi
  local missing=()
  while read -r _ part; do [[ -f $dest/$part ]] || missing+=("$part"); done < "$dest/SHA256SUMS"
  if (( ${#missing[@]} )); then echo "FA4: parts not here yet: ${missing[*]} (carry them first)"; return 1; fi
  (cd "$dest" && sha256sum -c --quiet SHA256SUMS)
  mkdir -p "$site"
  cat "$dest"/fa4.tar.xz.part-* | xz -dc | tar -C "$site" -xf -
  # where the host (or the .gpu bundle) has its own copy, keep it: one cuda-bindings / protobuf
  # per process
  if python3 -c "import cuda.bindings" 2> /dev/null; then rm -rf "$site"/cuda "$site"/cuda_bindings-* "$site"/cuda_pathfinder-*; fi
  if python3 -c "import google.protobuf" 2> /dev/null; then rm -rf "$site"/google "$site"/protobuf-*; fi
  if python3 -c "import einops" 2> /dev/null; then rm -rf "$site"/einops "$site"/einops-*; fi
  eval "$(env_line)"
  python3 -c "import importlib.metadata as m, flash_attn.cute, cutlass; print('flash-attn-4', m.version('flash-attn-4'), 'nvidia-cutlass-dsl', m.version('nvidia-cutlass-dsl'))"
  touch "$site/.fa4-ok"
}

env_line() {
  # the wheel's .pth adds dsl_packages to sys.path, which PYTHONPATH directories do not run
  echo "export PYTHONPATH=$site:$site/nvidia_cutlass_dsl/dsl_packages\${PYTHONPATH:+:\$PYTHONPATH}"
}

case ${1:-} in
  pack) pack ;;
  install) install ;;
  env) env_line ;;
  *) echo "usage: $0 pack|install|env" >&2; exit 2 ;;
esac
