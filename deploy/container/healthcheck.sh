#!/bin/bash
# The container's health check: GET /health on the API port, over bash's /dev/tcp (the
# image has no curl). Healthy when the answer is 200: /health answers 200 while the
# process serves, also "degraded" (etcd away: it keeps routing on its last table).
#
# The port is TESSERA_HEALTH_PORT, else the port of TESSERA_LISTEN (the address the
# image's `tessera` listens on, 0.0.0.0:8080 by default). A process listening on one
# address only (not 0.0.0.0) must set TESSERA_HEALTH_HOST to it.
set -euo pipefail
listen=${TESSERA_LISTEN:-127.0.0.1:8080}
port=${TESSERA_HEALTH_PORT:-${listen##*:}}
host=${TESSERA_HEALTH_HOST:-127.0.0.1}
exec 3<>"/dev/tcp/${host}/${port}"
printf 'GET /health HTTP/1.1\r\nHost: %s:%s\r\nConnection: close\r\n\r\n' "$host" "$port" >&3
IFS= read -r -t 5 status <&3
[[ $status == "HTTP/1."[01]" 200"* ]] || { echo "GET /health: ${status:-no answer}" >&2; exit 1; }
