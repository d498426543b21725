package ordering

import (
	"context"
	"encoding/json"
	"fmt"
	"runtime/debug"
	"time"

	"github.com/jmoiron/sqlx"

	"github.com/onceflow/onceflow/internal/textcol"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
)

// This file applies the messages parked behind a key once the one they wait for has come: in
// order, at most Config.MaxDrain at a time, under a savepoint that a failure rolls back.

// failure is a parked message that failed when it was applied.
type failure struct {
	msg parkedMsg
	err error
}

// drain applies, in tx, the parked messages of key that follow st.last without a gap, at most
// Config.MaxDrain of them, and returns the key's new state, which the caller writes. It runs
// them under a savepoint: when one fails, the savepoint is rolled back, the messages before it
// are applied again without one, and the failing one stays parked with its failure recorded.
// The key is then stalled at it, as it is when MaxDrain stopped the drain: the sweeper goes on.
// A failure in that second run, or of a statement, is returned: the caller's transaction must
// roll back. fresh tells whether the key has just moved (its wait restarts now) or is being
// retried (its wait goes on).
func (o *InOrder) drain(ctx context.Context, tx sqlx.ExtContext, next processor.Processor, key string, st keyState, fresh bool) (keyState, error) {
	st, _, _, err := o.drainFailing(ctx, tx, next, key, st, fresh)
	return st, err
}

// drainFailing is drain, and also returns the failure that stopped it, if any, and whether
// MaxDrain did.
func (o *InOrder) drainFailing(ctx context.Context, tx sqlx.ExtContext, next processor.Processor, key string, st keyState, fresh bool) (keyState, *failure, bool, error) {
	start := st.last
	if _, err := tx.ExecContext(ctx, "SAVEPOINT "+drainSavepoint); err != nil {
		return st, nil, false, fmt.Errorf("set savepoint before applying parked messages: %w", err)
	}
	last, failed, err := o.applyParked(ctx, tx, next, key, start, min(start+int64(o.cfg.MaxDrain), MaxSequence))
	if err != nil {
		return st, nil, false, err
	}
	// MaxDrain stopped it when it applied that many and the next one is parked too.
	more := false
	if failed == nil && last-start == int64(o.cfg.MaxDrain) {
		next, err := o.store.load(ctx, tx, o.cfg.Handler, key, last, 1)
		if err != nil {
			return st, nil, false, err
		}
		more = len(next) == 1 && next[0].Seq == last+1
	}
	if failed != nil {
		if _, err := tx.ExecContext(ctx, "ROLLBACK TO SAVEPOINT "+drainSavepoint); err != nil {
			return st, nil, false, fmt.Errorf("roll back to savepoint after parked sequence %d of key %s failed: %w", failed.msg.Seq, textcol.Quote(key), err)
		}
		if last > start {
			again, refailed, err := o.applyParked(ctx, tx, next, key, start, last)
			switch {
			case err != nil:
				return st, nil, false, err
			case refailed != nil:
				return st, nil, false, fmt.Errorf("parked sequence %d of key %s failed when applied again after sequence %d failed: %w",
					refailed.msg.Seq, textcol.Quote(key), failed.msg.Seq, refailed.err)
			case again != last:
				return st, nil, false, fmt.Errorf("parked messages of key %s changed while they were applied (sequence %d, then %d)", textcol.Quote(key), last, again)
			}
		}
		if err := o.store.fail(ctx, tx, o.cfg.Handler, key, failed.msg.Seq, failed.err, o.now().UnixMicro()); err != nil {
			return st, nil, false, err
		}
		o.cfg.Logger.Warn("parked message failed; it stays parked and its key waits for a retry",
			"handler", o.cfg.Handler, "key", key, "seq", failed.msg.Seq, "message_id", failed.msg.MessageID,
			"attempt", failed.msg.Attempts+1, "error", failed.err)
	}
	if last > start {
		if err := o.store.deleteRange(ctx, tx, o.cfg.Handler, key, start, last); err != nil {
			return st, nil, false, err
		}
	}
	st.parked -= last - start
	st.last = last
	st.stalled = failed != nil || more
	switch {
	case st.parked <= 0:
		st.parked, st.blocked, st.stalled = 0, 0, false
	case fresh || last > start:
		st.blocked = o.now().UnixMicro()
	}
	return st, failed, more, nil
}

// applyParked runs next for the parked messages of key after seq after, in order, as long as
// they follow each other without a gap and up to seq upTo. It returns the last sequence it
// applied, and the first message that failed, if one did; err is a failure to read them.
func (o *InOrder) applyParked(ctx context.Context, tx sqlx.ExtContext, next processor.Processor, key string, after, upTo int64) (int64, *failure, error) {
	last := after
	for last < upTo {
		batch, err := o.store.load(ctx, tx, o.cfg.Handler, key, last, drainChunk)
		if err != nil {
			return last, nil, err
		}
		for _, p := range batch {
			if p.Seq != last+1 || p.Seq > upTo {
				return last, nil, nil
			}
			if err := o.applyOne(ctx, next, key, p); err != nil {
				return last, &failure{msg: p, err: err}, nil
			}
			last = p.Seq
		}
		if len(batch) < drainChunk {
			break
		}
	}
	return last, nil, nil
}

// applyOne runs next for parked message p, and turns a panic into an error.
func (o *InOrder) applyOne(ctx context.Context, next processor.Processor, key string, p parkedMsg) (err error) {
	md, err := o.messageData(key, p)
	if err != nil {
		return processor.Permanent(err)
	}
	// ctx carries tx already: the handler's transaction, or the sweeper's.
	pctx := ctx
	if p.InternalID.Valid {
		pctx = middleware.WithInternalID(pctx, p.InternalID.String)
	}
	defer func() {
		if v := recover(); v != nil {
			pe, ok := v.(*processor.PanicError)
			if !ok {
				pe = &processor.PanicError{Value: v, Stack: debug.Stack()}
			}
			o.cfg.Logger.Error("parked message panicked", "handler", o.cfg.Handler, "key", key, "seq", p.Seq,
				"message_id", p.MessageID, "panic", fmt.Sprint(pe.Value), "stack", string(pe.Stack))
			err = pe
		}
	}()
	return next.Process(pctx, md)
}

// messageData rebuilds the MessageData of a parked message.
func (o *InOrder) messageData(key string, p parkedMsg) (*messagedata.MessageData, error) {
	md := &messagedata.MessageData{
		ID:       p.MessageID,
		Topic:    p.Topic,
		Key:      key,
		Sequence: uint64(p.Seq),
		Payload:  p.Payload,
		Attempt:  int(p.Attempts) + 1,
	}
	if p.Timestamp != 0 {
		md.Timestamp = time.UnixMicro(p.Timestamp).UTC()
	}
	if len(p.Headers) > 0 {
		if err := json.Unmarshal(p.Headers, &md.Headers); err != nil {
			return md, fmt.Errorf("decode the headers of parked message %q: %w", p.MessageID, err)
		}
	}
	return md, nil
}
