#!/usr/bin/env bash
# Pin every image reference of k8s/ to the digest its tag points at now: `name:tag` becomes
# `name:tag@sha256:<digest>` in k8s/*.yaml and in k8s/Dockerfile's FROM / ARG *IMAGE= lines (a
# reference that already carries a digest is re-resolved from its tag). Run it after pushing the
# recgrid images (k8s/README.md, step 1) and whenever a base image is to be updated; commit the
# result. Needs `crane` (github.com/google/go-containerregistry) or `docker buildx`, and access to
# the registries. tests/test_k8s.py checks that every reference carries a digest.
#   k8s/pin-images.sh            # resolve and rewrite
#   k8s/pin-images.sh --check    # list references without a digest; exit 1 if there are any
set -euo pipefail
cd "$(dirname "$0")"
files=(*.yaml Dockerfile)

refs() {  # every image reference, one per line
  { grep -hoE '^\s*(- )?image:\s*\S+' "${files[@]}" | awk '{print $NF}'
    grep -hoE '^(FROM\s+\S+|ARG\s+\w*IMAGE=\S+)' Dockerfile | sed -E 's/^FROM\s+//; s/^ARG\s+\w*IMAGE=//'
  } | grep -v '^\$' | sort -u
}

digest() {  # the digest a tag points at
  if command -v crane >/dev/null; then
    crane digest "$1"
  elif docker buildx version >/dev/null 2>&1; then
    docker buildx imagetools inspect "$1" --format '{{json .Manifest.Digest}}' | tr -d '"'
  else
    echo "pin-images.sh: needs crane or docker buildx to resolve $1" >&2
    exit 2
  fi
}

if [[ "${1:-}" == "--check" ]]; then
  unpinned=$(refs | grep -vE '@sha256:[0-9a-f]{64}$' || true)
  [[ -z "$unpinned" ]] && { echo "every image reference carries a digest"; exit 0; }
  echo "without a digest:"; echo "$unpinned"; exit 1
fi

for ref in $(refs); do
  tag="${ref%@sha256:*}"
  case "$tag" in registry.example.com/*)
    echo "skipping $tag: replace registry.example.com/ with your registry first (k8s/README.md, step 1)" >&2
    continue;;
  esac
  d=$(digest "$tag")
  [[ "$d" =~ ^sha256:[0-9a-f]{64}$ ]] || { echo "pin-images.sh: $tag resolved to '$d'" >&2; exit 1; }
  echo "$tag -> $d"
  for f in "${files[@]}"; do
    # the tag, with or without an old digest, followed by the end of the line, a space or a comment
    TAG="$tag" PINNED="$tag@$d" perl -pi -e 's/\Q$ENV{TAG}\E(\@sha256:[0-9a-f]{64})?(?=\s|$)/$ENV{PINNED}/g' "$f"
  done
done
