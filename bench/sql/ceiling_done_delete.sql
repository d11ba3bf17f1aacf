-- The SQL ceiling, part 2 ("bare delete"): mark the batch done by deleting it.
DELETE FROM jobd.jobs WHERE id = ANY (CAST(:ids AS bigint[]));
