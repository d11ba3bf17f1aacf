-- Whether a node's supervisor holds its LISTEN connection (jobd status): without it, the
-- node's workers wake on the fallback poll only. NULL: a node that does not report it.
ALTER TABLE nodes ADD COLUMN listening boolean;
