/**
 * Docker containers that crunch-run started inside a local VM. Like a real VM's disk, they go when the VM
 * goes: `destroy` removes every container labelled with the VM's root (crunch-run labels its containers
 * `dispatch-cloud.vm-root=<DISPATCH_VM_ROOT>`). Talks to the Docker Engine API on its unix socket; without a
 * daemon there is nothing to remove.
 */
import { existsSync } from "node:fs";
import http from "node:http";

export const VM_ROOT_LABEL = "dispatch-cloud.vm-root";

function dockerSocket(env: NodeJS.ProcessEnv): string {
  const host = env.DOCKER_HOST;
  if (host?.startsWith("unix://") === true) return host.slice("unix://".length);
  return "/var/run/docker.sock";
}

function call(socketPath: string, method: string, path: string): Promise<{ status: number; body: string }> {
  return new Promise((resolve, reject) => {
    const req = http.request({ socketPath, method, path, timeout: 10_000 }, (res) => {
      let body = "";
      res.setEncoding("utf8");
      res.on("data", (c: string) => {
        body += c;
      });
      res.on("end", () => resolve({ status: res.statusCode ?? 0, body }));
    });
    req.on("timeout", () => req.destroy(new Error(`docker ${method} ${path} timed out`)));
    req.on("error", reject);
    req.end();
  });
}

/** Force-removes the containers of the VM whose root is `vmRoot`; returns their ids. */
export async function removeVmContainers(
  vmRoot: string,
  env: NodeJS.ProcessEnv = process.env,
): Promise<string[]> {
  const socketPath = dockerSocket(env);
  if (!existsSync(socketPath)) return [];
  const filters = encodeURIComponent(JSON.stringify({ label: [`${VM_ROOT_LABEL}=${vmRoot}`] }));
  const list = await call(socketPath, "GET", `/containers/json?all=1&filters=${filters}`);
  if (list.status !== 200) throw new Error(`docker list containers: HTTP ${list.status}`);
  const ids = (JSON.parse(list.body) as { Id: string }[]).map((c) => c.Id);
  for (const id of ids) {
    const res = await call(socketPath, "DELETE", `/containers/${encodeURIComponent(id)}?force=1`);
    if (res.status !== 204 && res.status !== 404) throw new Error(`docker remove ${id}: HTTP ${res.status}`);
  }
  return ids;
}
