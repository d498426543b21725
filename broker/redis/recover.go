package redis

import (
	"context"
	"errors"
	"time"

	"github.com/ThreeDotsLabs/watermill"
	"github.com/redis/go-redis/v9"
)

// This file keeps a subscription going through failures and lost connections (recoverFrom).

// recoverFrom handles an error of Fetch, and returns an error only when the subscription
// must end.
func (s *subscription) recoverFrom(err error, failures int) error {
	switch {
	case s.sub.Stopped():
		return nil
	case errors.Is(err, redis.ErrClosed):
		s.cfg.log.Error("Redis client closed under a subscription; ending it", err, s.fields)
		return err
	case redis.HasErrorPrefix(err, "NOGROUP"):
		// The stream or the group was deleted: its entries, and so the deliveries in flight,
		// are gone. Start again on a new one.
		s.cfg.log.Info("Redis stream or consumer group vanished; creating it again", s.fields.Add(watermill.LogFields{"err": err}))
		s.sub.End(err, nil) // an ack or nack given before counts
		if err := s.ensureGroup(s.opCtx); err != nil {
			s.cfg.log.Error("Could not create the consumer group again", err, s.fields)
			s.sub.Sleep(backoff(failures))
			return nil
		}
		s.pass.restart()
	case isConnErr(err):
		s.reconnect(err)
	default:
		s.cfg.log.Error("Redis stream read failed", err, s.fields)
		s.sub.Sleep(backoff(failures))
	}
	return nil
}

// backoff returns the wait after the n-th failure in a row: 50 ms doubling up to 1 s.
func backoff(n int) time.Duration {
	return min(50*time.Millisecond<<min(max(n-1, 0), 5), time.Second)
}

// isConnErr reports whether err says that Redis could not be reached or did not answer, as
// opposed to an answer that is an error.
func isConnErr(err error) bool {
	if err == nil || errors.Is(err, redis.Nil) || errors.Is(err, context.Canceled) {
		return false
	}
	var rerr redis.Error
	return !errors.As(err, &rerr)
}

// reconnect handles a lost connection: it ends the deliveries in flight (they may have lost
// their acks), waits until Redis answers again, then gives back every entry of the consumer
// that is not settled or parked, including those a read delivered into the consumer's
// pending list while the reply was lost, and claims at once.
func (s *subscription) reconnect(cause error) {
	s.cfg.log.Error("Lost the connection to Redis; deliveries in flight are cancelled and given back once it is back", cause, s.fields)
	s.sub.End(errConnLost, nil)
	for n := 1; ; n++ {
		if s.sub.Stopped() {
			return
		}
		ctx, cancel := context.WithTimeout(s.opCtx, time.Second)
		err := s.client.Ping(ctx).Err()
		cancel()
		if err == nil {
			break
		}
		if !s.sub.Sleep(backoff(n)) {
			return
		}
	}
	if err := s.ensureGroup(s.opCtx); err != nil {
		s.cfg.log.Error("Could not check the consumer group after reconnecting", err, s.fields)
		return
	}
	if _, err := s.giveBack(s.opCtx); err != nil {
		s.cfg.log.Error("Could not give back the deliveries in flight at the loss; they come back after AckTimeout", err, s.fields)
	}
	s.pass.restart()
	s.cfg.log.Info("Reconnected to Redis", s.fields)
}

// ensureGroup creates the consumer group, and the stream, unless they exist.
func (s *subscription) ensureGroup(ctx context.Context) error {
	err := s.client.XGroupCreateMkStream(ctx, s.topic, s.group, "0").Err()
	if err != nil && !redis.HasErrorPrefix(err, "BUSYGROUP") {
		return err
	}
	return nil
}
