#!/usr/bin/env bash
# deploy.docker: checks deploy/docker/Dockerfile and Dockerfile.cuda without
# building them (no registry here):
#   tests/deploy/dockerfile.sh
# - hadolint, where installed (DL3008, unpinned apt versions, ignored);
# - what a COPY takes from the build context, and the repository paths a
#   RUN names, exist, and their .dockerignore does not leave them out;
# - the CMake targets a RUN builds exist, and the package a RUN installs is
#   the one CMakeLists.txt names (CPACK_PACKAGE_NAME);
# - the image runs as a user other than root, has a CMD and no ENTRYPOINT
#   (one image runs servers and workers) and EXPOSEs nothing.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
fail() { echo "FAIL: $*" >&2; exit 1; }
cd "$root"

if command -v hadolint >/dev/null; then
  hadolint --ignore DL3008 deploy/docker/Dockerfile deploy/docker/Dockerfile.cuda \
    || fail "hadolint"
  echo "docker: hadolint passes ($(hadolint --version | head -1))"
else
  echo "docker: no hadolint: the checks below only"
fi

pkg=$(sed -n 's/^set(CPACK_PACKAGE_NAME \([^ )]*\))$/\1/p' CMakeLists.txt)
[ -n "$pkg" ] || fail "no set(CPACK_PACKAGE_NAME ...) in CMakeLists.txt"

for df in deploy/docker/Dockerfile deploy/docker/Dockerfile.cuda; do
  [ -f "$df" ] || fail "no $df"
  # The instructions, continuation lines joined, comments dropped.
  instr=$(grep -v '^[[:space:]]*#' "$df" | sed -e ':a' -e '/\\$/N; s/\\\n/ /; ta')
  ignore=()
  if [ -f "$df.dockerignore" ]; then
    while IFS= read -r pat; do
      case "$pat" in ''|'#'*|'!'*) continue ;; esac
      ignore+=("$pat")
    done <"$df.dockerignore"
  fi
  # in_context PATH: PATH exists and no .dockerignore pattern leaves it out.
  in_context() {
    local path=${1%/} prefix pat
    compgen -G "$path" >/dev/null || fail "$df names '$1', which is not in the repository"
    prefix=$path
    while [ -n "$prefix" ] && [ "$prefix" != . ]; do
      for pat in "${ignore[@]}"; do
        # shellcheck disable=SC2053 # a glob, as .dockerignore's
        [[ $prefix == $pat ]] && fail "$df.dockerignore ($pat) leaves out '$1'"
      done
      [[ $prefix == */* ]] || break
      prefix=${prefix%/*}
    done
    return 0
  }
  n=0
  # COPY SRC... DEST from the build context (not --from=STAGE).
  while read -r -a words; do
    [ ${#words[@]} -gt 0 ] && [ "${words[0]^^}" = COPY ] || continue
    args=("${words[@]:1}")
    if [[ ${args[0]} == --from=* ]]; then continue; fi
    while [[ ${args[0]} == --* ]]; do args=("${args[@]:1}"); done
    for src in "${args[@]:0:${#args[@]}-1}"; do
      [ "$src" = . ] || { in_context "$src"; n=$((n + 1)); }
    done
  done <<<"$instr"
  # Repository paths in RUN lines (deploy/..., tests/..., proto/...).
  for path in $(grep -E '^RUN ' <<<"$instr" | grep -oE '(^|[[:space:]])(deploy|tests|proto|common|ps|worker|kernels)/[A-Za-z0-9_./-]+' || true); do
    in_context "$path"; n=$((n + 1))
  done
  # CMake targets built by name.
  for target in $(grep -oE -- '--target( [A-Za-z0-9_-]+)+' <<<"$instr" | sed 's/^--target//'); do
    grep -qE "^ *add_(executable|custom_target)\\(${target}[ )]" CMakeLists.txt \
      || fail "$df builds --target $target, which CMakeLists.txt does not define"
    n=$((n + 1))
  done
  # The package it installs, by name.
  for deb in $(grep -oE '[A-Za-z0-9.+-]+_\*\.deb' <<<"$instr" | sort -u); do
    [ "${deb%%_*}" = "$pkg" ] || fail "$df names the package ${deb%%_*}, CMakeLists.txt $pkg"
  done
  # The final stage: a user other than root, a CMD, no ENTRYPOINT, no EXPOSE.
  last=$(awk '/^FROM /{s=""} {s=s $0 "\n"} END{printf "%s", s}' <<<"$instr")
  user=$(grep -E '^USER ' <<<"$last" | tail -1 | awk '{print $2}')
  [ -n "$user" ] && [ "$user" != root ] && [ "$user" != 0 ] \
    || fail "$df: the image runs as root (no USER in its last stage)"
  grep -qE '^CMD ' <<<"$last" || fail "$df: no CMD"
  ! grep -qE '^ENTRYPOINT ' <<<"$instr" || fail "$df: an ENTRYPOINT (the image runs servers and workers)"
  ! grep -qE '^EXPOSE ' <<<"$instr" || fail "$df: EXPOSE (the ports are the flags')"
  echo "docker: $df: $n paths and targets it names exist; runs as $user, $(grep -E '^CMD ' <<<"$last")"
done
echo "PASS: deploy.docker"
