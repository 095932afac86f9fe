/**
 * The runner API, called by crunch-run with its per-bundle token. `start` moves the bundle
 * starting -> running only for the attempt the token was issued for; `finish` records the exit.
 */
import { Type } from "@sinclair/typebox";
import type { FastifyInstance, FastifyRequest } from "fastify";
import { DispatchCloudError } from "../lib/errors.ts";
import { finishBundle, markRunning } from "../store/transitions.ts";
import type { Bundle, TransitionResult } from "../store/types.ts";
import { authenticateRunner, runnerBundleOf } from "./auth.ts";
import type { RouteContext } from "./server.ts";
import { validate } from "./validate.ts";

const StartRequest = Type.Object({}, { additionalProperties: false });

const FinishRequest = Type.Object(
  {
    exitCode: Type.Integer({ minimum: 0, maximum: 255 }),
    reason: Type.Optional(Type.String({ maxLength: 1000 })),
    resourceUsage: Type.Optional(
      Type.Record(Type.String({ maxLength: 100 }), Type.Number({ minimum: 0, maximum: 1e18 }), {
        maxProperties: 100,
      }),
    ),
  },
  { additionalProperties: false },
);

const ACTOR = "runner";

function notCurrent(bundle: Bundle, result: TransitionResult & { ok: false }): DispatchCloudError {
  const now = result.current;
  const what = now === null ? "is gone" : `is ${now.state} at attempt ${now.attempt}`;
  return new DispatchCloudError(
    "runner.not_current",
    `attempt ${bundle.attempt} no longer owns bundle ${bundle.uuid}: it ${what}`,
  );
}

export function registerRunnerRoutes(app: FastifyInstance, ctx: RouteContext): void {
  const { db } = ctx;
  const onRequest = async (request: FastifyRequest) => {
    request.runnerBundle = await authenticateRunner(db, request);
  };

  app.post("/api/v1/runner/start", { onRequest }, async (request) => {
    const bundle = runnerBundleOf(request);
    if (request.body !== undefined) validate(StartRequest, request.body);
    const result = await markRunning(db, bundle.uuid, bundle.attempt, { actor: ACTOR });
    if (result.ok)
      return { uuid: result.bundle.uuid, state: result.bundle.state, attempt: result.bundle.attempt };
    // A retried start (the first answer was lost) finds its own attempt already running: that is success.
    const now = result.current;
    if (now !== null && now.state === "running" && now.attempt === bundle.attempt) {
      return { uuid: now.uuid, state: now.state, attempt: now.attempt };
    }
    throw notCurrent(bundle, result);
  });

  app.get("/api/v1/runner/spec", { onRequest }, async (request) => {
    const b = runnerBundleOf(request);
    return {
      uuid: b.uuid,
      attempt: b.attempt,
      command: b.command,
      image: b.image,
      env: b.env,
      resources: b.resources,
      limits: b.limits,
      dependencies: b.dependencies,
      gpuDevices: b.gpuDevices,
      instanceType: b.instanceType,
    };
  });

  app.post("/api/v1/runner/finish", { onRequest }, async (request) => {
    const bundle = runnerBundleOf(request);
    const body = validate(FinishRequest, request.body);
    const result = await finishBundle(db, bundle.uuid, bundle.attempt, {
      exitCode: body.exitCode,
      ...(body.reason === undefined ? {} : { reason: body.reason }),
      ...(body.resourceUsage === undefined ? {} : { resourceUsage: body.resourceUsage }),
      actor: ACTOR,
    });
    if (!result.ok) throw notCurrent(bundle, result);
    return { uuid: result.bundle.uuid, state: result.bundle.state, exitCode: result.bundle.exitCode };
  });
}
