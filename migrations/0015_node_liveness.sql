-- Each supervisor states how often it writes its row, so `jobd status` can tell a node that
-- stopped writing (gone: killed, frozen, cut off) from one whose next beat is not due yet,
-- whatever duty_interval each node runs with. Nullable: the daemons of the previous release
-- go on writing their rows without it (they are judged by a fixed window).
ALTER TABLE nodes ADD COLUMN heartbeat_interval float8;
