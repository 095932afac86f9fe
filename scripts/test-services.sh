#!/usr/bin/env bash
# Installs (if missing) and starts the services the test suite needs, then prints `export` lines for them.
# Usage: eval "$(bash scripts/test-services.sh)"   (run as root on Debian; idempotent)
set -euo pipefail
log() { echo "test-services: $*" >&2; }

PG_PORT=${DISPATCH_CLOUD_TEST_PG_PORT:-55432}
PG_DIR=${DISPATCH_CLOUD_TEST_PG_DIR:-/tmp/dispatch-cloud-test-pg}

need_apt=()
pg_bin=$(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -n 1 || true)
[ -n "$pg_bin" ] && [ -x "$pg_bin/initdb" ] || need_apt+=(postgresql)
[ -x /usr/sbin/sshd ] || need_apt+=(openssh-server)
command -v unshare >/dev/null || need_apt+=(util-linux)
command -v dockerd >/dev/null || need_apt+=(docker.io)
[ -x /bin/busybox ] || need_apt+=(busybox-static)
command -v promtool >/dev/null || need_apt+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    log "missing Debian packages: ${need_apt[*]}; install them as root: apt-get install -y ${need_apt[*]}"
    exit 1
  fi
  log "installing ${need_apt[*]} (apt-get)"
  apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >&2
  pg_bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -n 1)
fi

# PostgreSQL: a private cluster for tests, trust auth on loopback, owned by the postgres user.
as_pg() { if [ "$(id -u)" = 0 ]; then su postgres -s /bin/sh -c "$*"; else sh -c "$*"; fi; }
if ! "$pg_bin/pg_isready" -q -h 127.0.0.1 -p "$PG_PORT"; then
  if [ ! -f "$PG_DIR/PG_VERSION" ]; then
    log "initdb $PG_DIR"
    mkdir -p "$PG_DIR"
    [ "$(id -u)" = 0 ] && chown postgres: "$PG_DIR"
    as_pg "'$pg_bin/initdb' -D '$PG_DIR' -U postgres --auth=trust -E UTF8 >/dev/null"
  fi
  log "starting PostgreSQL on 127.0.0.1:$PG_PORT"
  as_pg "'$pg_bin/pg_ctl' -D '$PG_DIR' -l '$PG_DIR/server.log' -w -t 60 \
    -o \"-p $PG_PORT -k /tmp -c listen_addresses=127.0.0.1 -c max_connections=300 -c fsync=off \
    -c synchronous_commit=off -c full_page_writes=off\" start >/dev/null"
fi
# The user local VMs in openssh mode log in as: not root (root's shell start-up is slow on these machines),
# with /bin/sh as its shell.
VM_USER=${DISPATCH_CLOUD_TEST_VM_USER:-dcvm}
if [ "$(id -u)" = 0 ] && ! id "$VM_USER" >/dev/null 2>&1; then
  log "creating user $VM_USER (shell /bin/sh) for local VMs"
  useradd --create-home --shell /bin/sh "$VM_USER"
fi
# Docker: the daemon (started here if it does not answer), the VM user in the docker group, and the test images
# (no registry is reachable: images are made with `docker import` from a busybox-static root).
if ! docker version >/dev/null 2>&1; then
  if [ "$(id -u)" != 0 ]; then
    log "the Docker daemon does not answer; start it as root: dockerd &  (Debian package docker.io)"
    exit 1
  fi
  log "starting dockerd"
  nohup dockerd >/tmp/dispatch-cloud-dockerd.log 2>&1 &
  for _ in $(seq 1 60); do docker version >/dev/null 2>&1 && break; sleep 0.5; done
  docker version >/dev/null 2>&1 || { log "dockerd did not start; see /tmp/dispatch-cloud-dockerd.log"; exit 1; }
fi
if [ "$(id -u)" = 0 ] && ! id -nG "$VM_USER" | grep -qw docker; then
  getent group docker >/dev/null || groupadd docker
  usermod -aG docker "$VM_USER"
  chgrp docker /var/run/docker.sock && chmod 0660 /var/run/docker.sock
fi
TEST_IMAGE=dctest/busybox:1
if ! docker image inspect "$TEST_IMAGE" >/dev/null 2>&1; then
  log "making test image $TEST_IMAGE (docker import of a busybox-static root)"
  root=$(mktemp -d)
  mkdir -p "$root/bin" "$root/tmp" "$root/out" "$root/in"
  chmod 1777 "$root/tmp"
  cp /bin/busybox "$root/bin/busybox"
  for applet in $(/bin/busybox --list); do
    [ "$applet" = busybox ] || ln -s busybox "$root/bin/$applet"
  done
  tar -C "$root" -c . | docker import -c 'ENV PATH=/bin' - "$TEST_IMAGE" >/dev/null
  rm -rf "$root"
fi
# The README's first bundle names `busybox`; no registry is reachable, so the test image stands in for it.
if ! docker image inspect busybox >/dev/null 2>&1; then
  log "tagging $TEST_IMAGE as busybox (the README's first bundle uses that name)"
  docker tag "$TEST_IMAGE" busybox:latest
fi
# moto's S3-compatible server (test/s3-server.ts) for the S3 blob backend's tests, which start their own on a free
# port. It is the Python package moto of the machine image (pip; no Debian package carries it): found here, not
# installed. Without it test/cas-backend-s3.test.ts fails, saying how to get it.
MOTO=${DISPATCH_CLOUD_TEST_MOTO:-$(command -v moto_server || ls "${HOME:-/root}"/.pyenv/versions/*/bin/moto_server 2>/dev/null | sort -V | tail -n 1 || true)}
if [ -n "$MOTO" ] && "$MOTO" --help >/dev/null 2>&1; then
  echo "export DISPATCH_CLOUD_TEST_MOTO=$MOTO"
else
  log "moto_server not found: the S3 backend's tests will fail; install it with: pip install 'moto[server]'"
fi
echo "export DISPATCH_CLOUD_TEST_IMAGE=$TEST_IMAGE"
echo "export DISPATCH_CLOUD_TEST_VM_USER=$VM_USER"
echo "export DISPATCH_CLOUD_TEST_PG_URL=postgres://postgres@127.0.0.1:$PG_PORT/postgres"
