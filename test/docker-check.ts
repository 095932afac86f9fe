/**
 * For suites that need the real Docker daemon and a test image: fails (never skips) with how to get them.
 */
import type { DockerClient } from "../crunch-run/docker-api.ts";

export async function requireDockerImage(docker: DockerClient, image: string): Promise<void> {
  const ping = await docker.call("GET", "/_ping", undefined, { timeoutMs: 2000 }).catch((err: Error) => err);
  if (ping instanceof Error || ping.status !== 200) {
    throw new Error(
      `no Docker daemon answers at ${docker.socketPath} (${ping instanceof Error ? ping.message : ping.status}); ` +
        "install docker.io and start dockerd (scripts/test-services.sh does both, or set " +
        "DOCKER_HOST=unix:///path/to/docker.sock)",
    );
  }
  const found = await docker.call("GET", `/images/${encodeURIComponent(image)}/json`);
  if (found.status !== 200) {
    throw new Error(
      `the test image ${image} is missing; scripts/test-services.sh makes it (docker import -c 'ENV PATH=/bin' ` +
        `<busybox-static root tar> ${image})`,
    );
  }
}
