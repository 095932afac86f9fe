/**
 * The dispatcher's claims (staged -> starting, each with a fresh runner token) whose statement has not answered
 * yet, by the token's hash. Under `serve` the dispatcher hands a start document to an instance's warm pool while the
 * claim runs (dispatcher/pool/remote-runner.ts), so the pool's `start` call for that token can reach the runner
 * API before the claim has committed: the REST server in the same process waits here for the claim before it
 * looks the token up. Another REST server behind the same URL cannot; the warm pool asks it again for a while
 * (crunch-run/spare.ts, `claimInFlight`).
 */
export class ClaimsInFlight {
  readonly #byHash = new Map<string, Promise<void>>();

  /** Records a claim made with the token hashing to `tokenHash`, until it answers (whatever the answer). */
  add(tokenHash: string, claim: Promise<unknown>): void {
    const settled = claim.then(
      () => {},
      () => {},
    );
    this.#byHash.set(tokenHash, settled);
    void settled.then(() => {
      if (this.#byHash.get(tokenHash) === settled) this.#byHash.delete(tokenHash);
    });
  }

  /** Resolves once the claim made with this token hash has answered; undefined when none is in flight here. */
  settled(tokenHash: string): Promise<void> | undefined {
    return this.#byHash.get(tokenHash);
  }

  /** Claims in flight now. */
  get size(): number {
    return this.#byHash.size;
  }
}
