#!/usr/bin/env bash
# Create .venv and install loraplex into it. `scripts/install.sh test` adds the test extra
# (pinned reference versions of transformers + PEFT, pytest, ruff, mypy).
#
# Three steps: the venv (created if missing, its pip upgraded), torch, loraplex; torch and loraplex
# are skipped when already installed, and with nothing to install at all the script prints one line
# and touches nothing. A step that runs says what it installs and roughly how much it downloads,
# shows pip's progress lines and ends with its time; pip's whole output goes to .venv/install.log.
set -euo pipefail
cd "$(dirname "$0")/.."
extra="${1:-}"
PY="${PYTHON:-python3}"
VPY=.venv/bin/python
LOG=.venv/install.log
TORCH_PIN=2.13.0

# --- what is already done --------------------------------------------------------------------

have_venv=0
[ -x "$VPY" ] && have_venv=1

# Reads the installed version without importing torch (that alone takes seconds).
torch_version() {
  "$VPY" - 2>/dev/null <<'EOF'
import importlib.metadata, sys
try:
    v = importlib.metadata.version("torch")
except importlib.metadata.PackageNotFoundError:
    sys.exit(1)
major, minor = (int(x) for x in v.split("+")[0].split(".")[:2])
print(v)
sys.exit((major, minor) < (2, 11))
EOF
}
have_torch=0
installed_torch=""
if [ "$have_venv" = 1 ] && installed_torch=$(torch_version); then
  have_torch=1
fi

# The editable install needs redoing only when pyproject.toml changes. An install with an extra
# includes the plain one, so for no extra any stamp of this pyproject.toml will do.
stamp=".venv/.loraplex-installed${extra:+-$extra}"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
have_loraplex=0
if [ -n "$extra" ]; then
  candidates=("$stamp")
else
  candidates=(.venv/.loraplex-installed*)
fi
for f in "${candidates[@]}"; do
  if [ -f "$f" ] && [ "$(cat "$f")" = "$want" ]; then
    have_loraplex=1
  fi
done

if [ "$have_venv$have_torch$have_loraplex" = 111 ]; then
  echo "loraplex${extra:+ [$extra]} is installed and up to date (.venv)"
  exit 0
fi

# --- helpers -----------------------------------------------------------------------------------

step_started=0
step() {  # step N "what"
  step_started=$SECONDS
  echo "[$1/3] $2"
}
step_done() {
  echo "      done in $((SECONDS - step_started)) s"
}
fail() {
  echo "error: $*" >&2
  exit 1
}

# The lines of pip's output worth seeing (what it fetches, how big, what it installed), indented;
# with --progress-bar raw, a large download's "Progress N of M" lines become one line of percents.
show_pip() {
  local line trimmed cur total pct shown=-1
  while IFS= read -r line; do
    trimmed="${line#"${line%%[! ]*}"}"
    case "$trimmed" in
      "Downloading "*".metadata ("*) ;; # the small fetch of a wheel's metadata before the wheel
      "Progress "*)
        read -r _ cur _ total <<<"$line"
        if [ "${total:-0}" -ge 10000000 ] 2>/dev/null; then
          pct=$((cur * 100 / total / 10 * 10))
          if [ "$pct" -gt "$shown" ]; then
            [ "$shown" -lt 0 ] && printf '        '
            printf ' %d%%' "$pct"
            shown=$pct
            [ "$pct" -ge 100 ] && { echo; shown=-1; }
          fi
        fi
        ;;
      Collecting* | Downloading* | Processing* | Obtaining* | Installing* | Successfully* | ERROR* | error:*)
        [ "$shown" -ge 0 ] && { echo; shown=-1; }
        printf '      %s\n' "$line"
        ;;
    esac
  done
  [ "$shown" -ge 0 ] && echo
  return 0
}

bar=off
pip_install() {  # pip_install ARGS...: returns pip's exit status
  local status=0
  echo "--- pip install $* ($(date))" >>"$LOG"
  "$VPY" -m pip install --progress-bar "$bar" "$@" 2>&1 | tee -a "$LOG" | show_pip || status=$?
  return "$status"
}
pip_failed() {  # pip_failed STATUS WHAT
  fail "pip failed (exit status $1) while installing $2; pip's whole output is in $LOG"
}

# --- 1: the venv -------------------------------------------------------------------------------

total_started=$SECONDS
if [ "$have_venv" = 0 ]; then
  command -v "$PY" >/dev/null 2>&1 ||
    fail "no Python interpreter '$PY' (set PYTHON to a Python 3.11+ interpreter)"
  version=$("$PY" -c 'import sys; print("%d.%d.%d" % sys.version_info[:3])' 2>/dev/null || true)
  [ -n "$version" ] ||
    fail "'$PY' does not run as a Python interpreter (set PYTHON to a Python 3.11+ interpreter)"
  "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' ||
    fail "'$PY' is Python $version; loraplex needs 3.11 or newer (set PYTHON to one)"
  step 1 "creating .venv with $PY (Python $version) and upgrading pip (~2 MB download) ..."
  "$PY" -m venv .venv && [ -x "$VPY" ] ||
    fail "'$PY' -m venv .venv failed (on Debian/Ubuntu: apt install python3-venv)"
else
  step 1 "upgrading pip in .venv (~2 MB download) ..."
fi
pip_install --upgrade pip || pip_failed "$?" pip
# A recent pip prints download progress as plain lines (--progress-bar raw), which a pipe can
# carry; an older one shows no download progress here.
case "$("$VPY" -m pip install --help 2>/dev/null || true)" in
  *"raw]"*) bar=raw ;;
esac
step_done

# --- 2: torch ----------------------------------------------------------------------------------

# The pinned torch goes in first: left to the dependency resolver, an unpinned requirement can
# pull a multi-GB CUDA build.
if [ "$have_torch" = 1 ]; then
  echo "[2/3] torch $installed_torch is installed"
else
  step 2 "installing torch $TORCH_PIN (~200 MB download as the CPU build) ..."
  if ! pip_install "torch==$TORCH_PIN"; then
    echo "      pip could not install torch $TORCH_PIN; trying torch>=2.11 ..."
    pip_install "torch>=2.11" || pip_failed "$?" torch
  fi
  step_done
fi

# --- 3: loraplex -------------------------------------------------------------------------------

if [ "$have_loraplex" = 1 ]; then
  echo "[3/3] loraplex is installed (pyproject.toml unchanged)"
else
  if [ -n "$extra" ]; then
    step 3 "installing loraplex [$extra] and its dependencies (transformers, fastapi, peft, triton, ...; ~250 MB download) ..."
    pip_install -e ".[$extra]" || pip_failed "$?" "loraplex [$extra]"
  else
    step 3 "installing loraplex and its dependencies (transformers, fastapi, uvicorn, ...; ~50 MB download) ..."
    pip_install -e . || pip_failed "$?" loraplex
  fi
  echo "$want" >"$stamp"
  step_done
fi
echo "loraplex${extra:+ [$extra]} is installed in .venv ($((SECONDS - total_started)) s)"
