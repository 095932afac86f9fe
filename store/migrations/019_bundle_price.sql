-- What a bundle's current attempt is charged per hour: its share of its instance's price when the dispatcher
-- started it (chargePerHour, dispatcher/scheduler/eligible.ts). Every way out of `running` (finish, kill, the
-- instance lost or preempted, the runner giving the bundle back) adds that x the time the attempt ran to
-- cost_dollars, which so sums the bundle's attempts (docs/operations.md "Cost"). NULL: no price is known (a
-- user's own worker, a type without one, an attempt started before this migration): the attempt adds nothing.
ALTER TABLE bundles ADD COLUMN price_per_hour double precision;
