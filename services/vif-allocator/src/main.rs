use clap::Parser;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    kuryr_vif_allocator::run(kuryr_vif_allocator::Config::parse()).await
}
