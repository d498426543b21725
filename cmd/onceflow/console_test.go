package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"net/http"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/ThreeDotsLabs/watermill/message"
	"github.com/stretchr/testify/require"

	"github.com/onceflow/onceflow"
	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/broker/sqlitequeue"
	"github.com/onceflow/onceflow/internal/testsvc"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// syncBuffer is a bytes.Buffer that a command writes to while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

var consoleAddr = regexp.MustCompile(`onceflow console on (http://\S+)/ `)

// startConsole runs onceflow console with args on a free loopback port until the test ends,
// and returns its URL.
func startConsole(t *testing.T, args ...string) string {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	var out syncBuffer
	cmd := newRootCommand()
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetIn(strings.NewReader(""))
	cmd.SetArgs(append([]string{"console", "--listen", "127.0.0.1:0"}, args...))
	done := make(chan error, 1)
	go func() { done <- execute(ctx, cmd) }()
	var base string
	deadline := time.Now().Add(30 * time.Second)
	for base == "" {
		select {
		case err := <-done:
			cancel()
			t.Fatalf("onceflow console stopped before serving: %v\n%s", err, out.String())
		case <-time.After(10 * time.Millisecond):
		}
		if m := consoleAddr.FindStringSubmatch(out.String()); m != nil {
			base = m[1]
		}
		require.True(t, time.Now().Before(deadline), "onceflow console did not serve within 30 s: %s", out.String())
	}
	t.Cleanup(func() {
		cancel()
		require.NoError(t, <-done, out.String())
	})
	return base
}

// postJSON posts body to url as the console's page does: same origin, JSON.
func postJSON(t *testing.T, url, body string) (int, string) {
	t.Helper()
	req, err := http.NewRequest(http.MethodPost, url, strings.NewReader(body))
	require.NoError(t, err)
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Sec-Fetch-Site", "same-origin")
	res, err := http.DefaultClient.Do(req)
	require.NoError(t, err)
	defer res.Body.Close()
	out, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	return res.StatusCode, string(out)
}

func getJSONDoc(t *testing.T, url string, v any) {
	t.Helper()
	res, err := http.Get(url)
	require.NoError(t, err)
	defer res.Body.Close()
	body, err := io.ReadAll(res.Body)
	require.NoError(t, err)
	require.Equal(t, http.StatusOK, res.StatusCode, string(body))
	require.NoError(t, json.Unmarshal(body, v), string(body))
}

// The console beside a service on RabbitMQ and PostgreSQL: it finds a dead letter by its
// reason, replays it, and the message is applied exactly once.
func TestConsole_OnRabbitMQAndPostgreSQLReplaysADeadLetterThatIsThenAppliedOnce(t *testing.T) {
	t.Parallel()
	ctx := context.Background()
	const group = "billing"
	amqpURL := testsvc.AMQPURL(t)
	dbURL := testsvc.PostgresSchemaURL(t)
	topic, dlq := testsvc.UniqueName("orders"), testsvc.UniqueName("dead")
	t.Cleanup(func() { removeTopics(t, amqpURL, group, topic, dlq) })
	brokerURL := amqpURL + "?group=" + group

	// The service: a router applying each order once to PostgreSQL, dead-lettering what is
	// not JSON until the fix is deployed.
	b, err := broker.Open(ctx, brokerURL, broker.Options{})
	require.NoError(t, err)
	t.Cleanup(func() { require.NoError(t, b.Close()) })
	db, err := sqldb.Open(ctx, dbURL)
	require.NoError(t, err)
	t.Cleanup(func() { _ = db.Close() })
	_, err = db.ExecContext(ctx, `CREATE TABLE effects (id TEXT NOT NULL)`)
	require.NoError(t, err)
	var fixed atomic.Bool
	router, err := onceflow.NewRouter(onceflow.Config{DeadLetterPublisher: b.Publisher(), DeadLetterTopic: dlq,
		PurgeInterval: -1, Logger: slog.New(slog.DiscardHandler)})
	require.NoError(t, err)
	sub, err := b.Subscriber()
	require.NoError(t, err)
	require.NoError(t, router.AddHandler(onceflow.Handler{Name: "ledger", Topic: topic, Subscriber: sub, DB: db, QoS: onceflow.ExactlyOnce,
		Processor: processor.Func(func(ctx context.Context, msg *messagedata.MessageData) error {
			if !json.Valid(msg.Payload) && !fixed.Load() {
				return processor.Permanent(fmt.Errorf("payload %q is not JSON", msg.Payload))
			}
			tx, _ := processor.TxFromContext(ctx)
			_, err := tx.ExecContext(ctx, `INSERT INTO effects (id) VALUES ($1)`, msg.ID)
			return err
		})}))
	testsvc.StartRouter(t, router)
	effects := func(id string) int {
		var n int
		require.NoError(t, db.GetContext(ctx, &n, `SELECT COUNT(*) FROM effects WHERE id = $1`, id))
		return n
	}
	for _, m := range []*message.Message{message.NewMessage("order-1", []byte(`{"n": 1}`)), message.NewMessage("order-2", []byte(`n=2`))} {
		require.NoError(t, b.Publisher().Publish(topic, m))
	}
	testsvc.Eventually(t, 30*time.Second, func() bool {
		msgs, err := b.Peek(ctx, dlq, 10)
		require.NoError(t, err)
		return len(msgs) == 1 && effects("order-1") == 1
	}, "order-2 was never dead-lettered beside order-1's effect")

	args := []string{"--broker", brokerURL, "--db", dbURL, "--topic", dlq}
	// Read-only unless told otherwise.
	readOnly := startConsole(t, args...)
	status, body := postJSON(t, readOnly+"/api/dead-letters/replay", `{"ids": ["order-2"]}`)
	require.Equal(t, http.StatusForbidden, status, body)
	require.Contains(t, body, "onceflow console runs without --allow-changes")

	base := startConsole(t, append(args, "--allow-changes")...)
	var handlers struct {
		Source   string `json:"source"`
		Handlers []struct {
			Name         string `json:"name"`
			Topic        string `json:"topic"`
			Applied      *int64 `json:"applied"`
			DeadLettered *int64 `json:"dead_lettered"`
		} `json:"handlers"`
	}
	getJSONDoc(t, base+"/api/handlers", &handlers)
	require.Equal(t, "database", handlers.Source)
	require.Len(t, handlers.Handlers, 1)
	require.Equal(t, "ledger", handlers.Handlers[0].Name)
	require.Equal(t, topic, handlers.Handlers[0].Topic)
	require.EqualValues(t, 1, *handlers.Handlers[0].Applied)

	var list struct {
		DeadLetters []struct {
			ID     string `json:"id"`
			Reason string `json:"reason"`
		} `json:"dead_letters"`
	}
	getJSONDoc(t, base+"/api/dead-letters?reason=is+not+JSON", &list)
	require.Len(t, list.DeadLetters, 1)
	require.Equal(t, "order-2", list.DeadLetters[0].ID)
	require.Equal(t, `permanent: payload "n=2" is not JSON`, list.DeadLetters[0].Reason)

	fixed.Store(true) // the fix is deployed; the operator replays
	status, body = postJSON(t, base+"/api/dead-letters/replay", `{"ids": ["order-2"], "exact": true}`)
	require.Equal(t, http.StatusOK, status, body)
	var rep struct {
		Done []struct {
			ID string `json:"id"`
			To string `json:"to"`
		} `json:"done"`
		Failed []json.RawMessage `json:"failed"`
	}
	require.NoError(t, json.Unmarshal([]byte(body), &rep))
	require.Len(t, rep.Done, 1)
	require.Equal(t, "order-2", rep.Done[0].ID)
	require.Equal(t, topic, rep.Done[0].To)
	require.Empty(t, rep.Failed)

	testsvc.Eventually(t, 30*time.Second, func() bool { return effects("order-2") == 1 }, "the replayed order was never applied")
	getJSONDoc(t, base+"/api/dead-letters", &list)
	require.Empty(t, list.DeadLetters)
	// Replaying what is gone changes nothing; the effects stay one each.
	status, body = postJSON(t, base+"/api/dead-letters/replay", `{"ids": ["order-2"], "exact": true}`)
	require.Equal(t, http.StatusOK, status, body)
	require.Contains(t, body, `"not_found": [`+"\n"+`    "order-2"`)
	require.Equal(t, 1, effects("order-1"))
	require.Equal(t, 1, effects("order-2"))
}

func TestConsoleCommand_SaysWhatIsMissing(t *testing.T) {
	t.Setenv(envBroker, "")
	t.Setenv(envDB, "")
	t.Setenv(envDatabase, "")
	_, err := run(t, "console")
	require.ErrorContains(t, err, "nothing to show: pass --broker URL, --db URL or both")
	require.Equal(t, exitUsage, exitCode(err))
	_, err = run(t, "console", "--db", "sqlite://"+t.TempDir()+"/typo.db")
	require.ErrorContains(t, err, "no such database")
	queue := filepath.Join(t.TempDir(), "queue.db")
	q, err := sqlitequeue.Open(context.Background(), queue, sqlitequeue.Config{})
	require.NoError(t, err)
	require.NoError(t, q.Close())
	_, err = run(t, "console", "--broker", "sqlite://"+queue, "--listen", "256.0.0.1:1")
	require.ErrorContains(t, err, "--listen 256.0.0.1:1: ")
	require.Equal(t, exitUsage, exitCode(err))
}
