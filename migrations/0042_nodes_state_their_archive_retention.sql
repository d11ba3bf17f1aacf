-- Each node's retention pass dropped the archive past its own `archive.retention`: a second
-- node configured to keep a shorter history deleted what the first was configured to keep.
-- Nodes state their retention in their heartbeat, and a pass forgets only what every node
-- with a row (rows of nodes gone for an hour are pruned) would forget. NULL: a daemon of an
-- earlier release, which does not say.
ALTER TABLE nodes ADD COLUMN archive_retention float8;
