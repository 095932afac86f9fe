/**
 * Azure's Scheduled Events client and the supervisor's any-cloud notice client, against test/fake-imds.ts in its
 * EC2 and Azure flavours (real HTTP servers).
 */
import http from "node:http";
import type { AddressInfo } from "node:net";
import { afterAll, beforeAll, describe, expect, it } from "vitest";
import { FakeImds } from "../test/fake-imds.ts";
import {
  createAzureEventsClient,
  createSpotNoticeClient,
  EVENTS_PATH,
  PREEMPT_ACTION,
  parseScheduledEvents,
} from "./azure-events.ts";
import { ImdsError } from "./imds.ts";

const event = (over: Record<string, unknown>) => ({
  EventId: "e1",
  EventType: "Preempt",
  ResourceType: "VirtualMachine",
  Resources: ["dc-vm1"],
  EventStatus: "Scheduled",
  NotBefore: "Sun, 22 Nov 2026 21:00:30 GMT",
  ...over,
});

describe("Azure Scheduled Events", () => {
  it("a Preempt event for this VM (or for no VM in particular) is the notice; other events are not", () => {
    const doc = (...events: unknown[]) => ({ DocumentIncarnation: 3, Events: events });
    expect(parseScheduledEvents(doc(), "dc-vm1")).toBeNull();
    expect(parseScheduledEvents(doc(event({})), "dc-vm1")).toEqual({
      action: PREEMPT_ACTION,
      time: "Sun, 22 Nov 2026 21:00:30 GMT",
    });
    expect(parseScheduledEvents(doc(event({ Resources: ["dc-other"] })), "dc-vm1")).toBeNull();
    expect(parseScheduledEvents(doc(event({ Resources: [] })), "dc-vm1")?.action).toBe(PREEMPT_ACTION);
    for (const type of ["Reboot", "Redeploy", "Freeze", "Terminate"]) {
      expect(parseScheduledEvents(doc(event({ EventType: type })), "dc-vm1")).toBeNull();
    }
    // A Preempt after other events is still found; an unusable NotBefore does not hide it.
    expect(
      parseScheduledEvents(doc(event({ EventType: "Freeze" }), event({ NotBefore: "a\nb" })), "dc-vm1"),
    ).toEqual({ action: PREEMPT_ACTION, time: "an unknown time" });
  });

  it("refuses an answer without an Events list", () => {
    for (const bad of [null, 7, {}, { Events: "none" }]) {
      expect(() => parseScheduledEvents(bad, "dc-vm1")).toThrow(ImdsError);
    }
    expect(() => parseScheduledEvents({}, "dc-vm1")).toThrow(`${EVENTS_PATH}: the answer has no Events list`);
  });
});

describe("metadata clients against the fake services", () => {
  const azure = new FakeImds({ cloud: "azure" });
  const ec2 = new FakeImds();
  beforeAll(async () => {
    await azure.start();
    await ec2.start();
  });
  afterAll(async () => {
    await azure.stop();
    await ec2.stop();
  });

  it("the Azure client learns the VM's name, then reads its Scheduled Events with the Metadata header", async () => {
    const client = createAzureEventsClient({ endpoint: azure.endpointFor("dc-az1") });
    await client.token();
    expect(await client.spotNotice()).toBeNull();
    azure.interrupt("dc-az1");
    expect(await client.spotNotice()).toEqual({
      action: PREEMPT_ACTION,
      time: expect.stringMatching(/ GMT$/),
    });
    const mine = azure.requests.filter((r) => r.instanceId === "dc-az1");
    expect(mine.map((r) => r.path.split("?")[0])).toEqual([
      "/metadata/instance/compute",
      "/metadata/scheduledevents",
      "/metadata/scheduledevents",
    ]);
    expect(mine.every((r) => r.tokenValid)).toBe(true);
  });

  it("the supervisor's client uses EC2's IMDSv2 where it answers, else Azure's service, else fails naming both", async () => {
    const onEc2 = createSpotNoticeClient(ec2.endpointFor("i-1"));
    await onEc2.token();
    ec2.interrupt("i-1");
    expect((await onEc2.spotNotice())?.action).toBe("terminate");
    expect(azure.requests.some((r) => r.instanceId === "i-1")).toBe(false);

    const onAzure = createSpotNoticeClient(azure.endpointFor("dc-az2"));
    await onAzure.token();
    expect(await onAzure.spotNotice()).toBeNull();
    azure.interrupt("dc-az2");
    expect(await onAzure.spotNotice()).toMatchObject({ action: PREEMPT_ACTION });
    // One EC2 token request (answered 404 by Azure's service), then Azure's paths only.
    const paths = azure.requests.filter((r) => r.instanceId === "dc-az2").map((r) => r.path.split("?")[0]);
    expect(paths).toEqual([
      "/latest/api/token",
      "/metadata/instance/compute",
      "/metadata/scheduledevents",
      "/metadata/scheduledevents",
    ]);

    const closed = http.createServer();
    await new Promise<void>((ok) => closed.listen(0, "127.0.0.1", ok));
    const port = (closed.address() as AddressInfo).port;
    await new Promise<void>((ok) => closed.close(() => ok()));
    const nowhere = createSpotNoticeClient(`http://127.0.0.1:${port}`);
    const err = await nowhere.token().then(
      () => null,
      (e: unknown) => e,
    );
    expect(err).toBeInstanceOf(ImdsError);
    expect((err as Error).message).toMatch(/^neither EC2's IMDSv2 \(.*\) nor Azure's \(.*\) answers$/);
  });

  it("waits longer for the first Scheduled Events answer (Azure enables the service then), not for later ones", async () => {
    let eventsAsked = 0;
    const slow = http.createServer((req, res) => {
      const reply = () => {
        res.setHeader("Content-Type", "application/json");
        res.end(
          req.url?.startsWith("/metadata/instance/compute")
            ? JSON.stringify({ name: "dc-slow" })
            : JSON.stringify({ DocumentIncarnation: 1, Events: [] }),
        );
      };
      if (req.url?.startsWith("/metadata/scheduledevents")) {
        eventsAsked++;
        setTimeout(reply, 300);
      } else reply();
    });
    await new Promise<void>((ok) => slow.listen(0, "127.0.0.1", ok));
    try {
      const client = createAzureEventsClient({
        endpoint: `http://127.0.0.1:${(slow.address() as AddressInfo).port}`,
        timeoutMs: 100,
        firstEventsTimeoutMs: 2000,
      });
      expect(await client.spotNotice()).toBeNull();
      await expect(client.spotNotice()).rejects.toThrow(/no answer within 100 ms/);
      expect(eventsAsked).toBe(2);
    } finally {
      slow.closeAllConnections();
      await new Promise<void>((ok) => slow.close(() => ok()));
    }
  });
});
