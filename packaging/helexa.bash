#!/bin/bash
# /usr/bin/helexa, from the RPM: runs the helexa of the Python environment that
# /usr/libexec/helexa/setup-venv builds at /usr/lib/helexa/venv. Paths are taken relative
# to this script's real location, so an unpacked RPM tree works the same.
# `exec` keeps the PID: systemd's Type=notify/NotifyAccess=main hear the Python process.
here=$(dirname "$(readlink -f "${BASH_SOURCE[0]}")")
venv="$here/../lib/helexa/venv"
if [ ! -x "$venv/bin/helexa" ]; then
  echo "helexa: no Python environment at $(readlink -m "$here/../lib/helexa")/venv; build it with: sudo $(readlink -m "$here/../libexec/helexa/setup-venv")" >&2
  exit 1
fi
# The services set HELEXA_CONFIG; for `helexa keys …` and friends run as the helexa user
# (sudo -u helexa helexa …), the packaged file is the default too, where it is readable.
config="$(readlink -m "$here/../../etc/helexa/helexa.toml")"
if [ -z "${HELEXA_CONFIG:-}" ] && [ -r "$config" ]; then
  export HELEXA_CONFIG="$config"
fi
exec "$venv/bin/helexa" "$@"
