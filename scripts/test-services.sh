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
command -v docker-registry >/dev/null || need_apt+=(docker-registry)
command -v htpasswd >/dev/null || need_apt+=(apache2-utils)
command -v openssl >/dev/null || need_apt+=(openssl)
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
# Image registries (Debian's docker-registry, the CNCF distribution registry) on loopback, for the registry pull
# tests (test/e2e-registry.test.ts): one without auth, one with basic auth from an htpasswd file (the test user's
# password is made once and kept in $REG_DIR/auth-password). dockerd treats 127.0.0.0/8 registries as insecure
# (plain HTTP) by default. Both get the test image and dctest/pull:1 (the test image plus 8 MiB of random bytes, so
# a pull has something to download); neither is kept on the daemon under the registries' names, so bundles naming
# them pull. Storage persists in $REG_DIR/{open,auth}-data; the tests may start more registries on the open one's.
REG_DIR=${DISPATCH_CLOUD_TEST_REGISTRY_DIR:-/tmp/dispatch-cloud-test-registry}
REG_OPEN=127.0.0.1:${DISPATCH_CLOUD_TEST_REGISTRY_PORT:-55000}
REG_AUTH=127.0.0.1:${DISPATCH_CLOUD_TEST_REGISTRY_AUTH_PORT:-55001}
REG_USER=dctest
mkdir -p "$REG_DIR"
if [ ! -s "$REG_DIR/auth-password" ]; then
  (umask 077; head -c 18 /dev/urandom | base64 | tr '+/' '-_' > "$REG_DIR/auth-password")
fi
REG_PASSWORD=$(cat "$REG_DIR/auth-password")
if [ ! -s "$REG_DIR/htpasswd" ] || ! htpasswd -vbB "$REG_DIR/htpasswd" "$REG_USER" "$REG_PASSWORD" >/dev/null 2>&1; then
  htpasswd -cbB "$REG_DIR/htpasswd" "$REG_USER" "$REG_PASSWORD" >/dev/null 2>&1
fi
registry_config() { # name addr auth?
  {
    echo "version: 0.1"
    echo "log: {level: warn}"
    echo "storage: {filesystem: {rootdirectory: $REG_DIR/$1-data}, delete: {enabled: true}}"
    echo "http: {addr: \"$2\"}"
    if [ "$3" = auth ]; then echo "auth: {htpasswd: {realm: dctest, path: $REG_DIR/htpasswd}}"; fi
  } > "$REG_DIR/$1.yml"
}
start_registry() { # name addr auth? expected-status
  registry_config "$1" "$2" "$3"
  local code
  code=$(curl -s -o /dev/null -w '%{http_code}' "http://$2/v2/" || true)
  [ "$code" = "$4" ] && return 0
  log "starting docker-registry ($1) on $2"
  nohup docker-registry serve "$REG_DIR/$1.yml" >"$REG_DIR/$1.log" 2>&1 &
  for _ in $(seq 1 60); do
    code=$(curl -s -o /dev/null -w '%{http_code}' "http://$2/v2/" || true)
    [ "$code" = "$4" ] && return 0
    sleep 0.25
  done
  log "docker-registry ($1) did not answer on $2 (got HTTP $code); see $REG_DIR/$1.log"
  exit 1
}
start_registry open "$REG_OPEN" "" 200
start_registry auth "$REG_AUTH" auth 401
has_manifest() { # registry repo tag
  local auth=()
  [ "$1" = "$REG_AUTH" ] && auth=(-u "$REG_USER:$REG_PASSWORD")
  [ "$(curl -s -o /dev/null -w '%{http_code}' "${auth[@]}" \
    -H 'Accept: application/vnd.docker.distribution.manifest.v2+json' "http://$1/v2/$2/manifests/$3")" = 200 ]
}
push_to() { # registry image
  has_manifest "$1" "${2%%:*}" "${2##*:}" && return 0
  log "pushing $2 to $1"
  docker tag "$2" "$1/$2"
  if [ "$1" = "$REG_AUTH" ]; then
    local cfg
    cfg=$(mktemp -d)
    echo "$REG_PASSWORD" | DOCKER_CONFIG=$cfg docker login -u "$REG_USER" --password-stdin "$1" >/dev/null 2>&1
    DOCKER_CONFIG=$cfg docker push -q "$1/$2" >/dev/null
    rm -rf "$cfg"
  else
    docker push -q "$1/$2" >/dev/null
  fi
  docker rmi "$1/$2" >/dev/null
}
for reg in "$REG_OPEN" "$REG_AUTH"; do push_to "$reg" "$TEST_IMAGE"; done
# dctest/pull:1 lives in the registries only (its layer must be missing from the daemon for a pull to download it).
PULL_IMAGE=dctest/pull:1
if ! has_manifest "$REG_OPEN" dctest/pull 1 || ! has_manifest "$REG_AUTH" dctest/pull 1; then
  log "making $PULL_IMAGE ($TEST_IMAGE plus 8 MiB of random bytes)"
  ctx=$(mktemp -d)
  head -c 8388608 /dev/urandom > "$ctx/blob"
  printf 'FROM %s\nCOPY blob /data/blob\n' "$TEST_IMAGE" > "$ctx/Dockerfile"
  DOCKER_BUILDKIT=0 docker build -q -t "$PULL_IMAGE" "$ctx" >"$REG_DIR/build.log" 2>&1 \
    || { log "docker build of $PULL_IMAGE failed: see $REG_DIR/build.log"; exit 1; }
  rm -rf "$ctx"
  for reg in "$REG_OPEN" "$REG_AUTH"; do push_to "$reg" "$PULL_IMAGE"; done
  docker rmi "$PULL_IMAGE" >/dev/null
fi
echo "export DISPATCH_CLOUD_TEST_REGISTRY=$REG_OPEN"
echo "export DISPATCH_CLOUD_TEST_REGISTRY_AUTH=$REG_AUTH"
echo "export DISPATCH_CLOUD_TEST_REGISTRY_USER=$REG_USER"
echo "export DISPATCH_CLOUD_TEST_REGISTRY_PASSWORD=$REG_PASSWORD"
echo "export DISPATCH_CLOUD_TEST_REGISTRY_DATA=$REG_DIR/open-data"
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
