-- A fair claim finds the share keys with due jobs by a skip scan (due_keys): one step per key,
-- each "the first key after this one", which jobs_fair_idx answers in one descent since it
-- is ordered by key. The planner may instead read jobs_claimable_idx, ordered by run_at, and
-- sort what it reads: with the table's statistics taken while it was empty (a lane that was
-- idle, then got a burst), both cost the same to it, and the sort read every due job of the
-- priority at every step. A fair drain of 20,000 jobs across 10 keys at 1 x 10 ran at
-- 1,300 jobs/s against 36,000 without fairness, its claims taking 17-50 ms. No plan of the
-- function needs a sort, so sorts are priced out for it, as a worker's session prices out
-- sequential scans (docs/design/queue.md, "Plans that age").
ALTER FUNCTION due_keys(text, integer, text, text, timestamptz, bigint, timestamptz,
                        timestamptz, integer, integer[], text[], timestamptz[], bigint[])
    SET enable_sort = off;
