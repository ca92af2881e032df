#!/usr/bin/env bash
# README.md stays a page a newcomer reads, and the documentation's links
# lead somewhere: fails when README.md has 300 lines or more, or when a
# relative Markdown link or image of README.md or docs/*.md names a file
# that does not exist. Links to http(s) and other schemes, and links to an
# anchor of the same page (#...), are not checked; for PATH#ANCHOR only
# PATH is. Code blocks and `code spans` hold no links.
#   tests/docs/readme.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
max=300
status=0

lines=$(wc -l <"$root/README.md")
if [ "$lines" -ge "$max" ]; then
  echo "readme: README.md has $lines lines; keep it under $max (move the rest into docs/)"
  status=1
else
  echo "readme: README.md has $lines lines (under $max)"
fi

# Every link target of a Markdown file, one "LINE<TAB>TARGET" per line:
# inline links and images [text](target "title"), and reference
# definitions [label]: target.
targets() {
  awk '
    /^[ \t]*(```|~~~)/ { fence = !fence; next }
    fence { next }
    {
      line = $0
      gsub(/`[^`]*`/, "", line)
      if (match(line, /^[ \t]*\[[^]]+\]:[ \t]*[^ \t]+/)) {
        t = substr(line, RSTART, RLENGTH)
        sub(/^[ \t]*\[[^]]+\]:[ \t]*/, "", t)
        print FNR "\t" t
        next
      }
      while (match(line, /\]\([^)]*\)/)) {
        t = substr(line, RSTART + 2, RLENGTH - 3)
        line = substr(line, RSTART + RLENGTH)
        sub(/^[ \t]+/, "", t)
        sub(/[ \t].*$/, "", t)
        print FNR "\t" t
      }
    }' "$1"
}

checked=0
for f in "$root/README.md" "$root"/docs/*.md; do
  [ -f "$f" ] || continue
  dir=$(dirname "$f")
  rel=${f#"$root"/}
  while IFS=$'\t' read -r line target; do
    target=${target#<}
    target=${target%>}
    case "$target" in
      '' | '#'*) continue ;;               # an anchor of this page
    esac
    [[ $target =~ ^[a-zA-Z][a-zA-Z0-9+.-]*: ]] && continue   # http:, https:, mailto:, ...
    path=${target%%#*}
    path=${path%%\?*}
    path=${path//%20/ }
    [ -n "$path" ] || continue
    case "$path" in
      /*) resolved=$root$path ;;           # from the repository's root
      *) resolved=$dir/$path ;;
    esac
    checked=$((checked + 1))
    if [ ! -e "$resolved" ]; then
      echo "readme: $rel:$line: the link '$target' names '$path', which does not exist"
      status=1
    fi
  done < <(targets "$f")
done
echo "readme: $checked relative links checked in README.md and docs/*.md"
exit $status
