package redis

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/redis/go-redis/v9"

	"github.com/onceflow/onceflow/broker/internal/inflight"
)

// subscription is one consumer of one stream, the Redis side of one Subscribe call (an
// inflight.Source): in Fetch, it reads new entries (XREADGROUP), claims idle ones (XAUTOCLAIM)
// and nacked ones whose delay has passed (XCLAIM), and recovers from lost connections; it
// sends the acks given in coalesced XACKs (acks), and parks a nacked entry for its delay by
// its idle time at the server (nack.go).
type subscription struct {
	owner    *Subscriber
	client   redis.UniversalClient
	cfg      Config
	topic    string
	group    string
	consumer string
	fields   watermill.LogFields

	sub *inflight.Subscription[entryRef]

	// opCtx is the context of the Redis commands, cancelled when the end gives up or is done.
	opCtx    context.Context
	opCancel context.CancelFunc

	acks  *inflight.Writer[string] // the XACKs of the acks given
	parks sync.WaitGroup           // the goroutines that park nacked entries

	mu       sync.Mutex
	inflight map[string]*inflight.Delivery[entryRef] // delivered and not settled, by entry id
	acking   map[string]struct{}                     // acked, XACK not confirmed yet
	parked   map[string]*parked                      // nacked, waiting for their delay
	claims   parkHeap                                // parked entries to claim back when their delay ends
	// refreshes are the parked entries whose idle time must be pushed back; parkTimer does it
	// when the first is due, and hurries the engine when a claim is.
	refreshes parkHeap
	parkTimer *time.Timer
	parkAt    time.Time // when parkTimer fires; zero when it is stopped

	// readID is the Redis client id of readConn, 0 when there is none: the end unblocks its
	// XREADGROUP with CLIENT UNBLOCK.
	readID atomic.Int64

	// pass is the claim pass of the stream, shared with the Subscriber's other subscriptions
	// to it.
	pass *claimPass

	// State of Fetch alone.
	nextReap time.Time
	failures int
	// readConn is the connection of the XREADGROUPs, when the client can give one of its own
	// (a *redis.Client can, a cluster client cannot).
	readConn *redis.Conn
	readMu   sync.Mutex // guards readConn: the end drops it
	// closed is closed when Close returns: unblockReads stops.
	closed chan struct{}
}

// entryRef is what a delivery keeps of its stream entry.
type entryRef struct {
	id string
	// replied is when the read or claim that delivered the entry returned: the entry's idle
	// time at the server is at least the time since then (while it is ours).
	replied time.Time
}

// errSuperseded ends a delivery whose entry the subscription claimed again (its AckTimeout
// had passed at the server): its ack or nack must not touch the new delivery's entry.
var errSuperseded = errors.New("redis: the entry was delivered again")

// errConnLost ends the deliveries in flight when the connection to Redis is lost.
var errConnLost = errors.New("redis: connection lost: the entry is given back once Redis answers")

func newSubscription(owner *Subscriber, topic, consumer string) *subscription {
	s := &subscription{
		owner:    owner,
		client:   owner.client,
		cfg:      owner.cfg,
		topic:    topic,
		group:    owner.cfg.ConsumerGroup,
		consumer: consumer,
		closed:   make(chan struct{}),
		inflight: map[string]*inflight.Delivery[entryRef]{},
		acking:   map[string]struct{}{},
		parked:   map[string]*parked{},
		pass:     owner.claimPass(topic),
		fields: watermill.LogFields{
			"provider": "redis", "topic": topic, "consumer_group": owner.cfg.ConsumerGroup, "consumer": consumer,
		},
	}
	s.opCtx, s.opCancel = context.WithCancel(context.Background())
	s.parkTimer = time.AfterFunc(time.Hour, s.parkDue)
	s.parkTimer.Stop()
	return s
}

// whenStopping, once the subscription begins to end, unblocks its read and bounds the
// commands of the end by CloseTimeout.
func (s *subscription) whenStopping() {
	<-s.sub.Stopping()
	giveUp := time.AfterFunc(s.cfg.CloseTimeout, s.opCancel)
	defer giveUp.Stop()
	s.unblockReads(time.Now().Add(s.cfg.CloseTimeout))
}

// Fetch does the most urgent thing for up to n deliveries: claim back the parked entries
// whose delay has ended, claim entries left idle, or read new ones. It recovers from a
// failure before it returns, and fails only when the client is closed.
func (s *subscription) Fetch(ctx context.Context, n int) error {
	err := s.step(n)
	if err == nil {
		s.failures = 0
		return nil
	}
	s.failures++
	return s.recoverFrom(err, s.failures)
}

func (s *subscription) step(n int) error {
	now := time.Now()
	if !now.Before(s.nextReap) {
		s.nextReap = now.Add(reapInterval)
		s.reap()
	}
	if due := s.popDue(&s.claims, now, n); len(due) > 0 {
		s.mu.Lock()
		s.armPark(time.Time{})
		s.mu.Unlock()
		return s.claimParked(due)
	}
	if cursor, ok := s.pass.begin(now); ok {
		return s.claimIdle(n, cursor)
	}
	return s.read(n, s.blockTime(now))
}

// Settle takes a delivery out of the subscription's books as it ended: acked (its XACK
// queued), nacked (parked, in a goroutine of its own: a command to Redis), or neither (it
// stays pending as it is, for the end or a reconnect to give back). An ack or nack of a
// delivery superseded by a newer one of its entry counts for nothing.
func (s *subscription) Settle(d *inflight.Delivery[entryRef], o inflight.Outcome) {
	id := d.Data.id
	s.mu.Lock()
	if s.inflight[id] == d {
		delete(s.inflight, id)
	}
	if errors.Is(o.Cause, errSuperseded) {
		s.mu.Unlock()
		return
	}
	switch {
	case o.Acked:
		s.acking[id] = struct{}{}
		s.mu.Unlock()
		s.acks.Add(id)
	case o.Nacked:
		p := &parked{id: id, due: time.Now().Add(o.Delay), touchedAt: d.Data.replied, index: -1}
		if old := s.parked[id]; old != nil {
			s.unpark(old)
		}
		s.parked[id] = p
		s.parks.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.parks.Done()
			s.park(p)
		}()
	default:
		s.mu.Unlock()
	}
}

// Close sends the acks given before the end, gives back the entries pending for the consumer
// that are not acked or parked, and deletes the consumer from the group when nothing is left
// pending for it. It reports the acks it could not send.
func (s *subscription) Close(ctx context.Context) error {
	defer close(s.closed)
	defer s.opCancel()
	stop := context.AfterFunc(ctx, s.opCancel)
	defer stop()
	inflight.Wait(ctx, waitGroupDone(&s.parks))
	unsent, _ := s.acks.Close()
	s.parkTimer.Stop()

	var err error
	if len(unsent) > 0 {
		err = fmt.Errorf("redis: %d acks of stream %q (consumer group %q) were not sent before the close timeout (%s); those entries will be delivered again",
			len(unsent), s.topic, s.group, s.cfg.CloseTimeout)
	}
	left, gbErr := s.giveBack(s.opCtx)
	switch {
	case gbErr != nil:
		s.cfg.log.Error("Could not give back unsettled deliveries on close; they come back after AckTimeout", gbErr, s.fields)
	case left == 0:
		s.removeConsumer(s.opCtx)
	}
	s.dropReader()
	s.cfg.log.Info("Redis stream subscription ended", s.fields)
	return err
}

// waitGroupDone returns a channel closed when wg's count reaches zero.
func waitGroupDone(wg *sync.WaitGroup) <-chan struct{} {
	done := make(chan struct{})
	go func() {
		wg.Wait()
		close(done)
	}()
	return done
}
