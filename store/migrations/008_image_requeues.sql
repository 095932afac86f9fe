-- Registry outages (docs/images.md "Registries"): how many times a bundle's runner gave it back because its
-- image's registry was unavailable (crunchrun.image_unavailable). The first containers.unavailableImageRequeues of
-- them do not use up an attempt (max_attempts grows by one with each); later ones count like any other requeue.
ALTER TABLE bundles ADD COLUMN image_requeues integer NOT NULL DEFAULT 0;
