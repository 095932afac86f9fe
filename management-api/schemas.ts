/**
 * The management API's shapes, as TypeBox schemas: the views (views.ts) are typed by them, and the OpenAPI
 * document (openapi.ts) is built from them, so the document cannot drift from what the routes return.
 */
import { type Static, Type } from "@sinclair/typebox";
import { IDLE_BEHAVIORS, WORKER_STATES } from "../dispatcher/types.ts";
import { BUNDLE_STATES, GPU_STACKS } from "../store/types.ts";

const IsoTime = Type.String({ format: "date-time" });

export const InstanceItem = Type.Object(
  {
    instanceId: Type.String({
      description: "Cloud instance id, or creating-<n> while its create call is in flight.",
    }),
    address: Type.String({ description: "Address the dispatcher connects to (empty until known)." }),
    instanceType: Type.String({ description: "Configured instance type name." }),
    providerType: Type.String({ description: "The cloud's name of the type." }),
    price: Type.Number({ description: "Price per hour, as configured." }),
    state: Type.Union(
      WORKER_STATES.map((s) => Type.Literal(s)),
      { description: "Creates in flight are booting." },
    ),
    idleBehavior: Type.Union(IDLE_BEHAVIORS.map((b) => Type.Literal(b))),
    preempted: Type.Boolean({
      description:
        "A spot interruption notice arrived (crunch-run --list said preempted): no new bundles; shut down once idle.",
    }),
    problem: Type.Union([Type.String(), Type.Null()], {
      description:
        "Why it takes no bundles, may never take one, or is going away (the runner's first error line when it cannot run there, a failed deployment, a secret mismatch, broken, preempted, or the shutdown reason); null when nothing is wrong.",
    }),
    runningBundles: Type.Array(Type.String(), {
      description: "Uuids of the bundles whose runners are on it.",
    }),
    lastBusyAt: Type.Union([IsoTime, Type.Null()], {
      description:
        "Last time it had a runner (its creation or discovery time before that); null while creating.",
    }),
    stateSince: IsoTime,
    secondsInState: Type.Number(),
  },
  { additionalProperties: false },
);
export type InstanceItem = Static<typeof InstanceItem>;

export const InstanceList = Type.Object({ items: Type.Array(InstanceItem) }, { additionalProperties: false });

export const IdleBehaviorResult = Type.Object(
  { instanceId: Type.String(), idleBehavior: Type.Union(IDLE_BEHAVIORS.map((b) => Type.Literal(b))) },
  { additionalProperties: false },
);

export const InstanceKillResult = Type.Object(
  { instanceId: Type.String(), state: Type.Literal("shutdown") },
  { additionalProperties: false },
);

const Gpu = Type.Object({
  stack: Type.Union(GPU_STACKS.map((s) => Type.Literal(s))),
  deviceCount: Type.Integer(),
  vram: Type.Integer({ description: "Bytes." }),
  driverVersion: Type.Union([Type.String(), Type.Null()]),
  hardwareTarget: Type.Array(Type.String()),
});

export const BundleItem = Type.Object(
  {
    uuid: Type.String(),
    state: Type.Union(BUNDLE_STATES.map((s) => Type.Literal(s))),
    priority: Type.Integer(),
    resources: Type.Object({
      vcpus: Type.Number(),
      ram: Type.Integer({ description: "Bytes." }),
      scratch: Type.Integer({ description: "Bytes." }),
      gpu: Type.Union([Gpu, Type.Null()]),
      tag: Type.Optional(Type.String({ description: "Runs only where this tag is (docs/workers.md)." })),
      workersOnly: Type.Optional(Type.Boolean({ description: "Runs only on its owner's own workers." })),
    }),
    eligibleTypes: Type.Array(Type.String(), {
      description: "Instance types that can run it, cheapest first (empty: none can).",
    }),
    firstSeenAt: Type.String({ format: "date-time", description: "When it was first staged." }),
    schedulingStatus: Type.Union([Type.String(), Type.Null()], {
      description: "Why it is not running yet (staged bundles), as the scheduler's last pass saw it.",
    }),
    instanceId: Type.Union([Type.String(), Type.Null()], {
      description: "The instance it was started on (starting and running bundles).",
    }),
    workerId: Type.Optional(
      Type.String({
        description: "The user's worker it was given to (starting and running bundles; docs/workers.md).",
      }),
    ),
    placement: Type.Optional(
      Type.String({
        description:
          "Present when the scheduler chose its instance for its cache (docs/storage.md, Locality): " +
          '"placed for its cache: 1.2 GiB of 1.5 GiB of inputs held there". Kept while it is starting or running.',
      }),
    ),
  },
  { additionalProperties: false },
);
export type BundleItem = Static<typeof BundleItem>;

export const BundleList = Type.Object({ items: Type.Array(BundleItem) }, { additionalProperties: false });

export const BundleKillResult = Type.Object(
  { uuid: Type.String(), state: Type.Literal("killed") },
  { additionalProperties: false },
);

export const Health = Type.Object({ health: Type.Literal("OK") }, { additionalProperties: false });

export { ErrorResponse } from "../lib/openapi.ts";

export const UserWorkerItem = Type.Object(
  {
    id: Type.String(),
    ownerUuid: Type.String(),
    name: Type.String(),
    state: Type.Union(["new", "active", "draining", "stopped", "lost"].map((s) => Type.Literal(s))),
    disabled: Type.Boolean(),
    tags: Type.Array(Type.String()),
    slots: Type.Integer(),
    bundles: Type.Array(Type.String(), { description: "Bundles starting or running there." }),
    version: Type.Union([Type.String(), Type.Null()]),
    checkinAgeMs: Type.Union([Type.Number(), Type.Null()], {
      description: "Milliseconds since its last check-in.",
    }),
    fresh: Type.Boolean({ description: "It may be given bundles now (active, enabled, checked in lately)." }),
  },
  { additionalProperties: false },
);
export type UserWorkerItem = Static<typeof UserWorkerItem>;

export const UserWorkerList = Type.Object(
  { items: Type.Array(UserWorkerItem) },
  { additionalProperties: false },
);
