package ordering_test

import (
	"context"
	"fmt"
	"log"
	"os"
	"path/filepath"

	"github.com/onceflow/onceflow/dedup"
	"github.com/onceflow/onceflow/messagedata"
	"github.com/onceflow/onceflow/middleware"
	"github.com/onceflow/onceflow/ordering"
	"github.com/onceflow/onceflow/processor"
	"github.com/onceflow/onceflow/sqldb"
)

// Postings of one account arrive out of order and one twice. The in-order interceptor parks
// the early ones and applies each in sequence order, once. (The router builds this chain for
// ExactlyOnceInOrder handlers; here it is composed by hand.)
func Example() {
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "onceflow-ordering-example")
	if err != nil {
		log.Fatal(err)
	}
	defer os.RemoveAll(dir)
	db, err := sqldb.Open(ctx, "sqlite://"+filepath.Join(dir, "app.db"))
	if err != nil {
		log.Fatal(err)
	}
	defer db.Close()

	store, err := ordering.NewStore(db, ordering.StoreConfig{})
	if err != nil {
		log.Fatal(err)
	}
	ids, err := dedup.New(db, dedup.Config{})
	if err != nil {
		log.Fatal(err)
	}
	for _, migrate := range []func(context.Context) error{store.Migrate, ids.Migrate} {
		if err := migrate(ctx); err != nil {
			log.Fatal(err)
		}
	}
	inOrder, err := ordering.New(store, ordering.Config{Handler: "ledger"})
	if err != nil {
		log.Fatal(err)
	}
	apply := processor.Func(func(_ context.Context, md *messagedata.MessageData) error {
		fmt.Printf("  applied %s #%d\n", md.Key, md.Sequence)
		return nil
	})
	dedupe, err := middleware.Dedup{Store: ids}.Middleware(db, "ledger")
	if err != nil {
		log.Fatal(err)
	}
	chain := middleware.Chain(middleware.Transaction{}.Middleware(middleware.Pool(db)), dedupe, inOrder.Middleware())(apply)

	for _, seq := range []uint64{3, 1, 3, 2, 4} {
		fmt.Printf("delivered #%d\n", seq)
		md := &messagedata.MessageData{ID: fmt.Sprintf("posting-%d", seq), Key: "acct-7", Sequence: seq, Attempt: 1}
		if err := chain.Process(ctx, md); processor.IsDuplicate(err) {
			fmt.Println("  duplicate: acknowledged, not applied")
		} else if err != nil {
			log.Fatal(err)
		}
	}
	// Output:
	// delivered #3
	// delivered #1
	//   applied acct-7 #1
	// delivered #3
	//   duplicate: acknowledged, not applied
	// delivered #2
	//   applied acct-7 #2
	//   applied acct-7 #3
	// delivered #4
	//   applied acct-7 #4
}
