package conformance

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// The Outage scenario's sizes and timings.
const (
	// outageGood is the number of good messages, published outageRate a second.
	outageGood = 60
	outageRate = 30
	// outageCutAt is the number of good messages published before the database is cut.
	outageCutAt = 20
	// outageMaxDeliveries is the delivery limit of the scenario's handler.
	outageMaxDeliveries = 4
	// outageResume bounds the time from the database's return to the next message applied.
	outageResume = 5 * time.Second
	// outageMaxTaken bounds the deliveries that the handler takes and gives back: those it
	// held when the database went, and the few it takes while paused to tell whether the
	// outage is over.
	outageMaxTaken = 40
	// outageMaxLogLines bounds the router's log lines at warn level and above that are not of
	// a poison message: the pause, the resumption, and a pause again if a trial fails.
	outageMaxLogLines = 4
	// outageAllEnv names the environment variable that runs the Outage scenario in every dedup
	// mode (ONCEFLOW_CONFORMANCE_OUTAGE=all); by default it runs in the default mode, and by
	// offset with group commit where the broker gives positions.
	outageAllEnv = "ONCEFLOW_CONFORMANCE_OUTAGE"
)

// outageRedelivery are the handler's redelivery delays: the whole schedule of a message, from
// its first delivery to its last, takes their sum (plus the in-process retries, a few ms each).
var outageRedelivery = []time.Duration{100 * time.Millisecond, 200 * time.Millisecond, 400 * time.Millisecond}

// outageLength is how long the database stays cut: three times the whole redelivery
// schedule, in-process retries included (handlerSpec's Retry waits at most 50 ms).
func outageLength() time.Duration {
	var schedule time.Duration
	for _, d := range outageRedelivery {
		schedule += d
	}
	schedule += outageMaxDeliveries * 2 * 50 * time.Millisecond
	return 3 * schedule
}

// errOutagePoison is the failure of the scenario's poison messages, every time: retryable,
// so that only the delivery limit ends it.
var errOutagePoison = errors.New("outage poison: fails at every delivery (injected)")

// testOutage cuts the handler's database (through a loopback TCP proxy) in the middle of a
// drain of 60 good messages, published 30 a second, with 3 poison messages among them that
// fail at every delivery, for three times the whole redelivery schedule of a message, and
// restores it. No good message may be dead-lettered, lost or applied twice; each poison
// message is dead-lettered once, at the delivery limit; processing resumes within 5 s of the
// database's return; the handler takes few deliveries meanwhile (outageMaxTaken) and logs at
// most a handful of lines for the outage. It runs in the default dedup mode, and by offset
// where the broker gives positions (ONCEFLOW_CONFORMANCE_OUTAGE=all: every dedup mode that
// applies).
func testOutage(t *testing.T, f *fixture) {
	if scheme(f.dbURL) == "sqlite" {
		t.Skip("the embedded database is a file: there is no connection to cut")
	}
	modes := []middleware.DedupMode{middleware.DedupInsertFirst}
	all := outageAll()
	if all && f.mode == PerMessage {
		modes = append(modes, middleware.DedupCheckFirst) // group commit records ids without internal ones
	}
	if f.features.PositionIDs && (all || f.mode == GroupCommit) {
		modes = append(modes, middleware.DedupByOffset)
	}
	// A delivery that waits in the subscriber's window while the handler is paused keeps
	// its broker's ack deadline running (NATS AckWait, the SQL queues' leases): one that
	// passes is a delivery the broker counts and the router cannot see (docs/operations.md,
	// Outages). The scenario's deadline outlasts its outage.
	f.timings.AckTimeout = max(f.timings.AckTimeout, outageLength()+5*time.Second)
	b := f.openBroker(f.brokerURL)
	dead := f.collectDeadLetters(b)
	for _, m := range modes {
		f.outageRun(t, b, dead, m) // in turn, in the fixture's test: its helpers fail that test
	}
}

func outageAll() bool { return strings.EqualFold(os.Getenv(outageAllEnv), "all") }

// outageRun runs the scenario once, in dedup mode m.
func (f *fixture) outageRun(t *testing.T, b *broker.Broker, all *deadLetters, m middleware.DedupMode) {
	name := "outage_" + strings.ToLower(strings.TrimPrefix(m.String(), "Dedup"))
	topic := f.topic(name)
	// The dead letters of this run's handler.
	dead := func() []*message.Message {
		return slices.DeleteFunc(all.all(), func(dl *message.Message) bool {
			return dl.Metadata.Get(messagedata.HeaderDeadLetterHandler) != name
		})
	}

	// The handler's database, through a proxy that the scenario cuts (a connect while it is
	// cut is refused at once).
	px := f.proxy(f.dbURL)
	var appDB *sqldb.DB
	err := retryConnect(func() (err error) {
		appDB, err = sqldb.Open(context.Background(), px.url)
		return err
	})
	require.NoError(t, err, "open the database through the proxy")
	t.Cleanup(func() { _ = appDB.Close() })

	poison := make([]string, 3)
	for i := range poison {
		poison[i] = f.id(fmt.Sprintf("%s-poison%d", name, i))
	}
	lines := &outageLog{next: f.logger.Handler(), poison: poison, mu: &sync.Mutex{}, lines: &[]string{}, ahead: new(int)}
	spec := handlerSpec{
		Name: name, Topic: topic, DB: appDB, Dedup: m,
		MaxDeliveries: outageMaxDeliveries, Redelivery: outageRedelivery,
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if slices.Contains(poison, msg.ID) {
				return errOutagePoison
			}
			return writeEffect(ctx, name, msg)
		}),
	}
	n := f.startNodeLogged(b, slog.New(lines), nil, spec)
	status := func() onceflow.HandlerStatus { return n.router.Status()[0] }

	good := make([]string, outageGood)
	for i := range good {
		good[i] = f.id(fmt.Sprintf("%s-%02d", name, i))
	}
	var restored atomic.Int64 // unix nanos of the restore; 0 before
	var paused atomic.Bool
	var wg sync.WaitGroup
	tick := time.NewTicker(time.Second / outageRate)
	for i, id := range good {
		<-tick.C
		if i == outageCutAt {
			px.cut()
			wg.Go(func() {
				deadline := time.Now().Add(outageLength())
				for time.Now().Before(deadline) {
					if status().State.Kind == onceflow.StatePaused {
						paused.Store(true)
					}
					time.Sleep(10 * time.Millisecond)
				}
				px.restore(t)
				restored.Store(time.Now().UnixNano())
			})
		}
		if i%(outageGood/len(poison)) == outageGood/len(poison)/2 {
			f.publish(b, topic, poison[i/(outageGood/len(poison))], `{"poison":true}`)
		}
		f.publish(b, topic, id, fmt.Sprintf(`{"n":%d}`, i))
	}
	tick.Stop()
	wg.Wait()
	restoredAt := time.Unix(0, restored.Load())
	processed := status().Counts.Processed
	var resumedIn time.Duration
	testsvc.Eventually(t, waitFor, func() bool {
		if resumedIn == 0 && status().Counts.Processed > processed {
			resumedIn = time.Since(restoredAt)
		}
		dls := dead()
		return len(f.effectCounts(name)) == outageGood && len(dls) >= len(poison) && resumedIn > 0
	}, "%s: %v/%d good messages applied, dead letters %v, resumed after %v (processed %d at the restore), status %v", name,
		lazy(func() any { return len(f.effectCounts(name)) }), outageGood, lazy(func() any { return len(dead()) }),
		lazy(func() any { return resumedIn }), processed, lazy(func() any { return status() }))
	require.NoError(t, n.stop())

	st := status()
	t.Logf("Outage (%s, %s): database cut for %s; %d deliveries given back, processing resumed %s after its return; %d log lines for it "+
		"(and %d of records behind a given-back one)", m, f.mode, outageLength(), st.Counts.GivenBack, resumedIn.Round(time.Millisecond),
		lines.other(), lines.behind())
	require.True(t, paused.Load(), "the handler was paused during the outage")
	require.Positive(t, st.Counts.GivenBack, "deliveries given back during the outage")
	require.LessOrEqual(t, resumedIn, outageResume, "processing resumed within %s of the database's return", outageResume)
	require.LessOrEqual(t, st.Counts.GivenBack, int64(outageMaxTaken), "deliveries taken and given back")
	require.LessOrEqual(t, lines.other(), outageMaxLogLines, "log lines for the outage: %v", lines.texts())

	// Exactly one effect per good message, none of a poison message.
	counts := f.effectCounts(name)
	for _, id := range good {
		require.Equal(t, 1, counts[id], "%s has exactly one effect", id)
	}
	for _, id := range poison {
		require.Zero(t, counts[id], "poison %s has no effect", id)
	}
	// One dead letter per poison message, at the delivery limit; none of a good message.
	byID := map[string][]*message.Message{}
	for _, dl := range dead() {
		byID[dl.UUID] = append(byID[dl.UUID], dl)
	}
	require.Len(t, byID, len(poison), "dead-lettered messages: %v", slices.Collect(maps.Keys(byID)))
	for _, id := range poison {
		require.Len(t, byID[id], 1, "poison %s dead-lettered once", id)
		require.Contains(t, byID[id][0].Metadata.Get(messagedata.HeaderDeadLetterReason),
			fmt.Sprintf("delivery limit reached after %d deliveries: %v", outageMaxDeliveries, errOutagePoison), id)
	}
}

// outageLog counts the router's log records at warn level and above that are not about a
// poison message, and passes every record on to next.
type outageLog struct {
	next   slog.Handler
	poison []string

	// mu and lines are shared by the handlers WithAttrs and WithGroup return.
	mu    *sync.Mutex
	lines *[]string
	// ahead counts the lines of records that failed behind a given-back one (by offset).
	ahead *int
}

func (l *outageLog) Enabled(ctx context.Context, level slog.Level) bool {
	return level >= slog.LevelWarn || l.next.Enabled(ctx, level)
}

func (l *outageLog) Handle(ctx context.Context, r slog.Record) error {
	if r.Level >= slog.LevelWarn {
		ofPoison := false
		r.Attrs(func(a slog.Attr) bool {
			switch {
			case a.Key == "message_id" && slices.Contains(l.poison, a.Value.String()):
				ofPoison = true
			case a.Key == "error" && strings.Contains(a.Value.String(), middleware.ErrPositionAhead.Error()):
				// By offset, the records behind a given-back one in its partition fail
				// once, as behind any failed record: the by-offset chain's own retry.
				l.mu.Lock()
				*l.ahead++
				l.mu.Unlock()
				ofPoison = true
			}
			return true
		})
		if !ofPoison {
			l.mu.Lock()
			*l.lines = append(*l.lines, r.Message)
			l.mu.Unlock()
		}
	}
	if l.next.Enabled(ctx, r.Level) {
		return l.next.Handle(ctx, r)
	}
	return nil
}

func (l *outageLog) WithAttrs(attrs []slog.Attr) slog.Handler {
	c := *l
	c.next = l.next.WithAttrs(attrs)
	return &c
}

func (l *outageLog) WithGroup(name string) slog.Handler {
	c := *l
	c.next = l.next.WithGroup(name)
	return &c
}

func (l *outageLog) other() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return len(*l.lines)
}

func (l *outageLog) behind() int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return *l.ahead
}

func (l *outageLog) texts() []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.Clone(*l.lines)
}
