package deadletter_test

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/onceflow/onceflow/broker"
	"github.com/onceflow/onceflow/deadletter"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
)

// Find the dead letters of a reason, and replay them once the cause is fixed: each goes back
// to the topic it came from, with its own id, so duplicate detection applies it at most once.
func Example() {
	ctx := context.Background()
	dir, _ := os.MkdirTemp("", "deadletter")
	defer os.RemoveAll(dir)
	b, err := broker.Open(ctx, "sqlite://"+filepath.Join(dir, "queue.db"), broker.Options{})
	if err != nil {
		log.Fatal(err)
	}
	defer b.Close()
	// Two messages the router gave up, as its DeadLetter interceptor publishes them.
	for _, id := range []string{"order-17", "order-18"} {
		msg := &messagedata.MessageData{ID: id, Topic: "orders", Payload: []byte(`{"account": 7}`)}
		if err := middleware.PublishDeadLetter(ctx, b.Publisher(), "dead", "billing", msg, errors.New("account 7 is closed")); err != nil {
			log.Fatal(err)
		}
	}

	q, err := deadletter.New(b, deadletter.Config{Topic: "dead"})
	if err != nil {
		log.Fatal(err)
	}
	page, err := q.List(ctx, deadletter.Query{Filter: deadletter.Filter{Reason: "account 7"}, Limit: 10})
	if err != nil {
		log.Fatal(err)
	}
	for _, l := range page.Letters {
		fmt.Printf("%s from %s by %s: %s\n", l.ID, l.Topic, l.Handler, l.Reason)
	}

	rep, err := q.Replay(ctx, deadletter.ExactSelection(page.Letters), deadletter.ReplayOptions{})
	if err != nil {
		log.Fatal(err) // says how many were not replayed, and why the first was not
	}
	for _, r := range rep.Done {
		fmt.Printf("replayed %s to %s\n", r.Letter.ID, r.To)
	}
	// Output:
	// order-17 from orders by billing: account 7 is closed
	// order-18 from orders by billing: account 7 is closed
	// replayed order-17 to orders
	// replayed order-18 to orders
}
