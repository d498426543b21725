package amqp

import (
	"math/rand/v2"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
)

var t0 = time.Date(2026, 12, 1, 12, 0, 0, 0, time.UTC)

const (
	testDelay = 2 * time.Millisecond
	testHold  = 100 * time.Millisecond
)

func coalesce(prefetch int, tags ...uint64) *coalescer {
	c := newCoalescer(prefetch, testDelay, testHold)
	for _, t := range tags {
		c.win.add(t)
	}
	return c
}

func multi(tag uint64) ackFrame  { return ackFrame{tag: tag, multiple: true} }
func single(tag uint64) ackFrame { return ackFrame{tag: tag} }

func at(d time.Duration) time.Time { return t0.Add(d) }

func TestCoalescer_AcksInOrderGoAsOneFrameAfterTheDelay(t *testing.T) {
	c := coalesce(8, 1, 2, 3, 4, 5, 6, 7, 8)
	for _, tag := range []uint64{1, 2, 3} {
		require.Empty(t, c.ack(tag, t0, time.Millisecond))
	}
	due, ok := c.due()
	require.True(t, ok)
	require.Equal(t, at(testDelay), due)
	require.Empty(t, c.expire(at(time.Millisecond)), "not due yet")
	require.Equal(t, []ackFrame{multi(3)}, c.expire(due))
	_, ok = c.due()
	require.False(t, ok, "nothing waits")
}

func TestCoalescer_HalfTheWindowAckedGoesAtOnce(t *testing.T) {
	c := coalesce(8, 1, 2, 3, 4, 5, 6, 7, 8)
	for _, tag := range []uint64{1, 2, 3} {
		require.Empty(t, c.ack(tag, t0, time.Millisecond))
	}
	require.Equal(t, []ackFrame{multi(4)}, c.ack(4, t0, time.Millisecond))
}

// A batch settled together goes at once when the consumer says so (redelivery.Flush), as one
// frame; an ack behind an open delivery still waits for it.
func TestCoalescer_FlushSendsThePrefixAtOnce(t *testing.T) {
	c := coalesce(8, 1, 2, 3, 4, 5, 6, 7, 8)
	for _, tag := range []uint64{1, 2, 3, 5} {
		require.Empty(t, c.ack(tag, t0, time.Millisecond))
	}
	require.Equal(t, []ackFrame{multi(3)}, c.flushPrefix())
	require.Equal(t, 1, c.win.nAcked, "5 waits behind the open 4")
	require.Empty(t, c.flushPrefix(), "nothing at the front to send")
	require.Empty(t, c.ack(4, t0, time.Millisecond))
	require.Equal(t, []ackFrame{multi(5)}, c.flushPrefix())
}

// Deliveries processed concurrently finish in any order: an ack behind an older delivery
// waits for it, and both go in one frame.
func TestCoalescer_AcksOutOfOrderWaitForTheOlderDelivery(t *testing.T) {
	c := coalesce(8, 1, 2, 3, 4, 5, 6, 7, 8)
	require.Empty(t, c.ack(3, t0, 10*time.Millisecond))
	require.Empty(t, c.ack(2, t0, 10*time.Millisecond))
	due, _ := c.due()
	require.Equal(t, at(20*time.Millisecond), due, "twice the mean time to ack")
	require.Empty(t, c.expire(at(5*time.Millisecond)))
	require.Empty(t, c.ack(1, at(5*time.Millisecond), 10*time.Millisecond))
	due, _ = c.due()
	require.Equal(t, at(testDelay), due, "the oldest ack waiting is older than the delay")
	require.Equal(t, []ackFrame{multi(3)}, c.expire(at(5*time.Millisecond)), "three acks, one frame")
	require.Equal(t, 0, c.win.nAcked)
}

func TestCoalescer_AnAckBehindAStuckDeliveryGoesAloneAfterItsWait(t *testing.T) {
	c := coalesce(8, 1, 2, 3, 4, 5, 6, 7, 8)
	require.Empty(t, c.ack(2, t0, 10*time.Millisecond))
	require.Empty(t, c.ack(3, at(5*time.Millisecond), 10*time.Millisecond))
	require.Equal(t, []ackFrame{single(2)}, c.expire(at(20*time.Millisecond)))
	due, _ := c.due()
	require.Equal(t, at(25*time.Millisecond), due, "3 waits for its own time")
	require.Equal(t, []ackFrame{single(3)}, c.expire(due))
	require.Empty(t, c.ack(1, at(30*time.Millisecond), 10*time.Millisecond))
	require.Equal(t, []ackFrame{single(1)}, c.expire(at(40*time.Millisecond)), "1 alone: 2 and 3 are settled")
	require.Equal(t, uint64(3), c.win.base)
}

func TestCoalescer_TheWaitBehindAnOlderDeliveryIsBounded(t *testing.T) {
	c := coalesce(8, 1, 2)
	require.Empty(t, c.ack(2, t0, time.Second))
	require.Equal(t, testHold, c.outOfOrder(), "slow processing: the bound")
	due, _ := c.due()
	require.Equal(t, at(testHold), due)

	c = coalesce(8, 1, 2)
	require.Empty(t, c.ack(2, t0, time.Microsecond))
	require.Equal(t, testDelay, c.outOfOrder(), "fast processing: at least the delay")
}

func TestCoalescer_EveryAckGoesWhenNoDeliveryIsOpen(t *testing.T) {
	c := coalesce(8, 1, 2, 3)
	c.nack(1, held)
	require.Empty(t, c.ack(3, t0, time.Millisecond))
	require.False(t, c.idleDue(), "2 is open")
	require.Empty(t, c.idleFlush())
	require.Empty(t, c.ack(2, t0, time.Millisecond))
	require.True(t, c.idleDue())
	require.Equal(t, []ackFrame{single(2), single(3)}, c.idleFlush(),
		"1 is held: nothing can be acked with multiple")
	c.nack(1, gone)
	require.Empty(t, c.win.states)
}

func TestCoalescer_ANackSentLetsTheAcksBehindItGoAsOne(t *testing.T) {
	c := coalesce(8, 1, 2, 3, 4)
	c.nack(1, held)
	require.Empty(t, c.ack(2, t0, time.Millisecond))
	require.Empty(t, c.ack(3, t0, time.Millisecond))
	c.nack(1, gone)
	require.Empty(t, c.idleFlush(), "4 is open")
	due, _ := c.due()
	require.Equal(t, at(testDelay), due)
	require.Equal(t, []ackFrame{multi(3)}, c.expire(due))
}

func TestCoalescer_FlushSendsEveryAckGiven(t *testing.T) {
	c := coalesce(8, 1, 2, 3, 4, 5)
	require.Empty(t, c.ack(1, t0, time.Millisecond))
	require.Empty(t, c.ack(2, t0, time.Millisecond))
	require.Empty(t, c.ack(4, t0, time.Millisecond))
	require.Equal(t, []ackFrame{multi(2), single(4)}, c.flush())
	require.Empty(t, c.flush())
}

func TestCoalescer_AnAckOfATagNotOpenIsIgnored(t *testing.T) {
	c := coalesce(8, 1, 2)
	require.Empty(t, c.ack(9, t0, time.Millisecond), "never delivered")
	require.Empty(t, c.ack(1, t0, time.Millisecond))
	require.Empty(t, c.ack(1, t0, time.Millisecond), "acked already")
	require.Equal(t, 1, c.win.nAcked)
	require.Equal(t, []ackFrame{single(1)}, c.expire(at(testDelay)), "a run of one tag")
}

// Random deliveries, acks, held and sent nacks and timer runs, against a model of RabbitMQ's
// settlement: a multiple ack settles every unsettled tag up to its own. No frame may settle a
// tag the consumer did not ack, none may settle a tag twice, every ack given is sent by the
// final flush, and no ack waits past its bound.
func TestCoalescer_NeverSettlesATagTheConsumerDidNotAck(t *testing.T) {
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 1))
		prefetch := 1 + rng.IntN(32)
		c := newCoalescer(prefetch, testDelay, testHold)
		var (
			now       = t0
			next      = uint64(1)
			open      = map[uint64]bool{} // delivered, not settled by the consumer
			holding   = map[uint64]bool{}
			ackedAt   = map[uint64]time.Time{} // acked by the consumer, not settled
			unsettled = map[uint64]bool{}      // at RabbitMQ
		)
		apply := func(frames []ackFrame) {
			for _, f := range frames {
				require.True(t, unsettled[f.tag], "seed %d: ack of a settled tag %d", seed, f.tag)
				for tag := range unsettled {
					if tag == f.tag || (f.multiple && tag < f.tag) {
						_, acked := ackedAt[tag]
						require.True(t, acked, "seed %d: frame %+v settles tag %d, not acked", seed, f, tag)
						delete(unsettled, tag)
						delete(ackedAt, tag)
					}
				}
			}
		}
		pick := func(m map[uint64]bool) (uint64, bool) {
			for tag := range m {
				return tag, true
			}
			return 0, false
		}
		for range 400 {
			switch r := rng.IntN(10); {
			case r < 3 && len(unsettled) < prefetch:
				c.win.add(next)
				open[next], unsettled[next] = true, true
				next++
			case r < 7:
				if tag, ok := pick(open); ok {
					delete(open, tag)
					ackedAt[tag] = now
					apply(c.ack(tag, now, time.Duration(rng.IntN(20))*time.Millisecond))
					apply(c.idleFlush()) // the session's fetch, when no delivery is open
				}
			case r < 8:
				if tag, ok := pick(open); ok {
					delete(open, tag)
					holding[tag] = true
					c.nack(tag, held)
					apply(c.idleFlush())
				}
			case r < 9:
				if tag, ok := pick(holding); ok {
					delete(holding, tag)
					delete(unsettled, tag) // the nack is sent
					c.nack(tag, gone)
					apply(c.idleFlush())
				}
			default:
				now = now.Add(time.Duration(rng.IntN(30)) * time.Millisecond)
				for due, ok := c.due(); ok && !due.After(now); due, ok = c.due() {
					apply(c.expire(now))
				}
				for tag, a := range ackedAt {
					require.Less(t, now.Sub(a), testHold, "seed %d: ack of %d waits too long", seed, tag)
				}
			}
		}
		apply(c.flush())
		require.Empty(t, ackedAt, "seed %d: acks given and not sent", seed)
		require.Equal(t, len(open)+len(holding), len(unsettled), "seed %d", seed)
	}
}
