-- A claim's lease token came from lease_token_seq. Claims commit without waiting for their
-- WAL flush (claim_commits_async), and a sequence writes its progress to the WAL only every
-- 32 values, and at its first use after a checkpoint, with nothing but the next flushed commit
-- to make that record durable. A crash of the server could therefore undo a claim together
-- with the sequence's last steps: the job went back to pending and the next claim, most
-- likely of the same job, drew the same token again. Two workers then held the same (id,
-- token) pair, and the one whose claim was undone (its handler still running, its
-- connection back) passed the fence: its heartbeat renewed the other's lease, its outcome
-- finished the job under the other's feet.
--
-- A token now holds 63 bits of gen_random_uuid() (the server's strong random source), so
-- nothing a crash undoes can make it repeat: the same job drawing the same token twice is a
-- 2^-59 chance (four of the bits taken are the uuid's fixed version bits). The claims draw one
-- per statement, as before. lease_token_seq stays for the daemons of the previous release
-- during a rolling upgrade (docs/upgrades.md); their sequence values and these tokens share
-- the column without meaning anything but equality.
CREATE FUNCTION new_lease_token() RETURNS bigint
LANGUAGE sql VOLATILE PARALLEL SAFE
AS $$
    SELECT ('x' || substr(replace(gen_random_uuid()::text, '-', ''), 1, 16))::bit(64)::bigint
           & 9223372036854775807
$$;
