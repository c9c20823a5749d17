#!/usr/bin/env bash
# Makes the 'austen' text source available (the out-of-distribution evaluation text of the
# tests and benchmarks): the Jane Austen novels of Debian's r-cran-janeaustenr. nmprune reads
# the R data files with the Python package rdata, so R is not needed: the .deb is unpacked into
# ${NMPRUNE_R_LIBS:-~/.cache/nmprune/R}, where nmprune looks for it (as well as in R_LIBS and
# Debian's R libraries). Run by scripts/install.sh; safe to run again.
# Prints the R library that holds janeaustenr (Debian's when the package is installed).
set -euo pipefail
if dpkg -s r-cran-janeaustenr >/dev/null 2>&1; then
  echo "/usr/lib/R/site-library"; exit 0
fi
dest=${NMPRUNE_R_LIBS:-$HOME/.cache/nmprune/R}
lib="$dest/usr/lib/R/site-library"
if [ ! -f "$lib/janeaustenr/data/Rdata.rdb" ]; then
  tmp=$(mktemp -d)
  (cd "$tmp" && { apt-get download r-cran-janeaustenr >/dev/null 2>&1 \
                  || { apt-get update >/dev/null && apt-get download r-cran-janeaustenr >/dev/null; }; })
  mkdir -p "$dest"
  dpkg-deb -x "$tmp"/r-cran-janeaustenr_*.deb "$dest"
  rm -rf "$tmp"
fi
echo "$lib"
