/**
 * The executor's limit on concurrent channels per connection (sshd refuses past its MaxSessions): a counting
 * semaphore whose waiters get a slot in arrival order, and can all be failed at once when the connection is
 * refused or the executor closes.
 */
import type { SshError } from "../../lib/executor.ts";

export interface Slot {
  release(): void;
  /** Set when the slot is released later, once a killed command's channel has closed. */
  deferred: boolean;
}

export class ChannelSlots {
  private active = 0;
  private readonly waiters: { resolve: () => void; reject: (err: SshError) => void }[] = [];

  constructor(private readonly max: number) {}

  /** Commands holding a slot. */
  get running(): number {
    return this.active;
  }

  /** Commands waiting for one. */
  get queued(): number {
    return this.waiters.length;
  }

  async acquire(): Promise<Slot> {
    if (this.active >= this.max) {
      await new Promise<void>((resolve, reject) => this.waiters.push({ resolve, reject }));
    } else {
      this.active++;
    }
    let released = false;
    return {
      deferred: false,
      release: () => {
        if (released) return;
        released = true;
        const next = this.waiters.shift();
        if (next)
          next.resolve(); // the slot passes straight to the next waiter
        else this.active--;
      },
    };
  }

  /** Fails every waiting command with `err`. */
  rejectAll(err: SshError): void {
    for (const w of this.waiters.splice(0)) w.reject(err);
  }
}
