#!/usr/bin/env bash
# The flag tables of docs/flags.md are the programs' own: each table between
#   <!-- flags: PROGRAM -->  and  <!-- end flags -->
# must be exactly what `PROGRAM --help-markdown` prints (the table that
# also drives parsing and --help). With --fix, rewrites the page's tables.
#   tests/docs/flags.sh BUILD_DIR [--fix]
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
build=${1:?usage: flags.sh BUILD_DIR [--fix]}
fix=${2:-}
page=$root/docs/flags.md
name=docs/flags.md
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
status=0
for prog in ps-server ps-worker ps-export ps-import-keras ps-ctr-gen ps-stale ps-loadgen ps-plan; do
  "$build/$prog" --help-markdown >"$tmp/$prog.md"
  "$build/$prog" --help >"$tmp/$prog.help"
  # Every flag of the table is in --help, and --help has no other.
  grep -o '^| `--[a-z-]*' "$tmp/$prog.md" | sed 's/^| `//' | sort >"$tmp/$prog.md-flags"
  grep -o '^  --[a-z-]*' "$tmp/$prog.help" | sed 's/^  //' | grep -v '^--help$' | sort >"$tmp/$prog.help-flags"
  if ! diff -u "$tmp/$prog.md-flags" "$tmp/$prog.help-flags"; then
    echo "flags: $prog --help and --help-markdown list different flags"
    status=1
  fi
  # The page's table for prog (the lines between the markers).
  awk -v p="$prog" '
    $0 == "<!-- flags: " p " -->" { on = 1; found = 1; next }
    on && $0 == "<!-- end flags -->" { on = 0; next }
    on { print }
    END { if (!found) exit 3 }' "$page" >"$tmp/$prog.page" || {
    echo "flags: $name has no '<!-- flags: $prog -->' table"
    status=1
    continue
  }
  if ! diff -u "$tmp/$prog.page" "$tmp/$prog.md" >"$tmp/$prog.diff"; then
    if [ "$fix" = --fix ]; then
      awk -v p="$prog" -v f="$tmp/$prog.md" '
        $0 == "<!-- flags: " p " -->" { print; while ((getline l < f) > 0) print l; skip = 1; next }
        skip && $0 == "<!-- end flags -->" { skip = 0 }
        !skip { print }' "$page" >"$tmp/page.new"
      cp "$tmp/page.new" "$page"
      echo "flags: rewrote the $prog table of $name"
    else
      echo "flags: $name's $prog table differs from '$prog --help-markdown' (- $name, + program):"
      cat "$tmp/$prog.diff"
      echo "flags: run tests/docs/flags.sh $build --fix to rewrite it"
      status=1
    fi
  else
    echo "flags: $name's $prog table matches $prog --help-markdown ($(grep -c '^| `--' "$tmp/$prog.md") flags)"
  fi
done
exit $status
