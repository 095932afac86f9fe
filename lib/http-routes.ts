/**
 * The routes a fastify server serves, as it registered them (an onRoute hook), so that checks over every route
 * (the property test of both APIs) cover a new route without being edited.
 */
import type { FastifyInstance } from "fastify";

export interface RouteEntry {
  method: string;
  /** As registered, with its parameters: `/api/v1/bundles/:uuid`, `/api/v1/bundles/:uuid/outputs/*`. */
  url: string;
}

const registered = new WeakMap<FastifyInstance, RouteEntry[]>();

/** Starts recording the routes of `app` (and of its child scopes); call it before registering any. */
export function recordRoutes(app: FastifyInstance): void {
  const list: RouteEntry[] = [];
  registered.set(app, list);
  app.addHook("onRoute", (route) => {
    for (const method of [route.method].flat()) list.push({ method, url: route.url });
  });
}

/** The routes recorded for `app`, in registration order (HEAD routes that fastify adds for GETs included). */
export function routesOf(app: FastifyInstance): readonly RouteEntry[] {
  return registered.get(app) ?? [];
}
