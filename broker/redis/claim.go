package redis

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"github.com/redis/go-redis/v9"
)

// XCLAIM and XAUTOCLAIM add one to the delivery count of each entry they take (unless JUSTID
// is given) and reset its idle time. A claimed entry's count is read from the pending entries
// list (XPENDING) right after the claim, while nobody else can claim it.

// claimPass is the walk over a stream's pending entries list that claims the entries idle
// for AckTimeout, shared by the subscriptions of one Subscriber to the stream: they are
// consumers of one group, and one pass finds the idle entries for all of them. Each step is
// one XAUTOCLAIM, by whichever subscription has room; the next pass starts ClaimInterval
// after one ends.
type claimPass struct {
	mu     sync.Mutex
	next   time.Time // when the next step may start
	cursor string    // where it starts
	busy   bool      // a step is running
}

// claimPass returns the claim pass of topic.
func (s *Subscriber) claimPass(topic string) *claimPass {
	s.mu.Lock()
	defer s.mu.Unlock()
	p := s.passes[topic]
	if p == nil {
		p = &claimPass{cursor: "0-0"}
		s.passes[topic] = p
	}
	return p
}

// begin starts a step at now, and returns its cursor; false when none is due or one runs.
func (p *claimPass) begin(now time.Time) (string, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.busy || now.Before(p.next) {
		return "", false
	}
	p.busy = true
	return p.cursor, true
}

// end ends a step that reached next ("0-0": the end of the list) at replied, or failed.
func (p *claimPass) end(next string, replied time.Time, interval time.Duration, failed bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.busy = false
	if failed || next == "0-0" {
		// The pass ends here (after a failure too: reads go on), and the next one starts
		// from the beginning.
		p.cursor, p.next = "0-0", replied.Add(interval)
		return
	}
	p.cursor, p.next = next, replied // the pass goes on
}

// restart makes a new pass start at once, from the beginning.
func (p *claimPass) restart() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.cursor, p.next = "0-0", time.Time{}
}

// due returns when the next step may start.
func (p *claimPass) due() time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.next
}

// claimIdle claims up to room entries of the group that have been idle for AckTimeout:
// deliveries of consumers that died, closed or lost their connection, and nacked entries
// whose delay has ended; one step of the stream's claim pass, which begin started at cursor.
func (s *subscription) claimIdle(room int, cursor string) error {
	sent := time.Now()
	msgs, next, err := s.client.XAutoClaim(s.opCtx, &redis.XAutoClaimArgs{
		Stream: s.topic, Group: s.group, Consumer: s.consumer,
		MinIdle: ceilMs(s.cfg.AckTimeout), Start: cursor, Count: int64(room),
	}).Result()
	replied := time.Now()
	s.pass.end(next, replied, s.cfg.ClaimInterval, err != nil)
	if err != nil {
		return fmt.Errorf("XAUTOCLAIM: %w", err)
	}
	return s.deliverClaimed(msgs, sent, replied)
}

// deliverClaimed delivers entries the consumer has just claimed, with their delivery counts.
func (s *subscription) deliverClaimed(msgs []redis.XMessage, sent, replied time.Time) error {
	if len(msgs) == 0 {
		return nil
	}
	ids := make([]string, len(msgs))
	for i, m := range msgs {
		ids[i] = m.ID
	}
	pending, err := s.pending(ids)
	if err != nil {
		// Claimed and not delivered: reconnect gives them back.
		return fmt.Errorf("XPENDING of claimed entries: %w", err)
	}
	entries := make([]entry, 0, len(msgs))
	for i, m := range msgs {
		if xp := pending[i]; xp.ID == m.ID && xp.Consumer == s.consumer {
			entries = append(entries, entry{msg: m, count: int(xp.RetryCount)})
		}
		// Otherwise acknowledged since (an XACK of an earlier delivery): nothing to deliver.
	}
	s.deliver(entries, sent, replied)
	return nil
}

// pending returns what the group's pending entries list says of each entry of ids, in
// order; the zero value for one that is not pending.
func (s *subscription) pending(ids []string) ([]redis.XPendingExt, error) {
	pipe := s.client.Pipeline()
	cmds := make([]*redis.XPendingExtCmd, len(ids))
	for i, id := range ids {
		cmds[i] = pipe.XPendingExt(s.opCtx, &redis.XPendingExtArgs{Stream: s.topic, Group: s.group, Start: id, End: id, Count: 1})
	}
	if _, err := pipe.Exec(s.opCtx); err != nil && !errors.Is(err, redis.Nil) {
		return nil, err
	}
	out := make([]redis.XPendingExt, len(ids))
	for i, c := range cmds {
		if xps, err := c.Result(); err == nil && len(xps) == 1 {
			out[i] = xps[0]
		}
	}
	return out, nil
}

// giveBackPage is how many pending entries one XPENDING of giveBack lists.
const giveBackPage = 1000

// giveBack makes every entry pending for the consumer claimable by any consumer of the group
// at once (XCLAIM to itself with IDLE AckTimeout and JUSTID, which leaves the delivery count
// alone), except those that are in flight, acked or parked. It returns how many entries are
// pending for the consumer, the given back ones included.
func (s *subscription) giveBack(ctx context.Context) (int, error) {
	start, pendingN := "-", 0
	for {
		xps, err := s.client.XPendingExt(ctx, &redis.XPendingExtArgs{
			Stream: s.topic, Group: s.group, Start: start, End: "+", Count: giveBackPage, Consumer: s.consumer,
		}).Result()
		if err != nil {
			return pendingN, fmt.Errorf("XPENDING of consumer %q on stream %q: %w", s.consumer, s.topic, err)
		}
		pendingN += len(xps)
		var back []redis.XPendingExt
		s.mu.Lock()
		for _, xp := range xps {
			_, acked := s.acking[xp.ID]
			if s.inflight[xp.ID] == nil && s.parked[xp.ID] == nil && !acked {
				back = append(back, xp)
			}
		}
		s.mu.Unlock()
		if len(back) > 0 {
			pipe := s.client.Pipeline()
			for _, xp := range back {
				// The minimum idle time is what XPENDING just saw: if another consumer claims
				// the entry in between, its idle time restarts and this does nothing.
				pipe.Do(ctx, "XCLAIM", s.topic, s.group, s.consumer, ms(xp.Idle), xp.ID, "IDLE", ms(ceilMs(s.cfg.AckTimeout)), "JUSTID")
			}
			if _, err := pipe.Exec(ctx); err != nil {
				return pendingN, fmt.Errorf("XCLAIM to give back %d entries of stream %q: %w", len(back), s.topic, err)
			}
		}
		if len(xps) < giveBackPage {
			return pendingN, nil
		}
		start = "(" + xps[len(xps)-1].ID
	}
}

// Consumers of closed or dead subscriptions stay in the group until deleted (the package
// documentation says when; a live one's next read creates it again). The check and the
// deletion are one script, so that no entry is delivered to a consumer between the two (XGROUP
// DELCONSUMER drops the consumer's pending entries from the group).
const (
	reapInterval = 10 * time.Minute
	reapIdle     = 10 * time.Minute
)

// reapScript deletes the consumers of group ARGV[1] on stream KEYS[1] that have no pending
// entries and an idle time of at least ARGV[2] ms, only the one named ARGV[3] unless it is
// empty. It returns how many it deleted.
var reapScript = redis.NewScript(`
local deleted = 0
for _, c in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local f = {}
  for i = 1, #c, 2 do f[c[i]] = c[i + 1] end
  if f['pending'] == 0 and f['idle'] >= tonumber(ARGV[2]) and (ARGV[3] == '' or f['name'] == ARGV[3]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], f['name'])
    deleted = deleted + 1
  end
end
return deleted
`)

// reap deletes the group's consumers that have nothing pending and have not been seen for
// reapIdle.
func (s *subscription) reap() {
	err := reapScript.Run(s.opCtx, s.client, []string{s.topic}, s.group, ms(reapIdle), "").Err()
	if err != nil && !redis.HasErrorPrefix(err, "NOGROUP") && !isConnErr(err) {
		s.cfg.log.Error("Could not delete the idle consumers of the group", err, s.fields)
	}
}

// removeConsumer deletes the subscription's consumer from the group if it has nothing pending.
func (s *subscription) removeConsumer(ctx context.Context) {
	err := reapScript.Run(ctx, s.client, []string{s.topic}, s.group, 0, s.consumer).Err()
	if err != nil && !redis.HasErrorPrefix(err, "NOGROUP") {
		s.cfg.log.Error("Could not delete the consumer from the group", err, s.fields)
	}
}
